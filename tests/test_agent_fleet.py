"""Two ORT agents and the coordinator through a real Mosquitto: a 2-round FedPer run.

The final aggregated base must equal an independent in-process ORT computation (same data, split,
seeds and batch order; no MQTT, no coordinator, no state dir) within 1e-4 relative, and the base
that `fedper-emulate` (PyTorch) computes from the same data, initial weights, seeds and batch order.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from fedper.aggregation import WeightedMean
from fedper.data import load_digits
from fedper.edge.agent import Agent, AgentConfig, load_local_data
from fedper.edge.backend import check_artifacts, open_backend
from fedper.edge.state import DeviceState

pytestmark = pytest.mark.mosquitto
CLASSES = ("0", "1", "2", "3")
ROUNDS, BATCH, LR, SEED = 2, 16, 0.02, 7


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fedper.export.exporter import export_artifacts

    out = tmp_path_factory.mktemp("fleet") / "export"
    export_artifacts(out, model="mobilenet_v1", kp=1, num_classes=4, input_size=32, width=0.25,
                     algorithm="fedper", classes=CLASSES)
    return out


def device_data(tmp_path: Path) -> list[Path]:
    """Non-IID real digits: device 0 holds classes 0-1, device 1 classes 2-3, 20 images each (16 train)."""
    ds = load_digits(32).train
    paths = []
    for j, classes in enumerate(((0, 1), (2, 3))):
        idx = np.flatnonzero(np.isin(ds.y, classes))[:20]
        path = tmp_path / f"device{j}.npz"
        np.savez(path, x_train=ds.x[idx], y_train=ds.y[idx], classes=np.array(CLASSES))
        paths.append(path)
    return paths


def reference_base(artifacts: Path, data: list[Path], tmp_path: Path) -> dict[str, np.ndarray]:
    """FedPer by hand: each round, every device loads the base + its own head, trains, and the base
    is the n_j-weighted mean of the devices' shared tensors."""
    manifest = check_artifacts(artifacts)
    backend = open_backend("ort", artifacts, manifest)
    shared_names, local_names = manifest.names(shared=True), manifest.names(shared=False)
    base = backend.read(shared_names)
    heads = [backend.read(local_names) for _ in data]
    local = [load_local_data(p, manifest, DeviceState(tmp_path / f"ref{j}"), SEED) for j, p in enumerate(data)]
    for round_ in range(1, ROUNDS + 1):
        mean = WeightedMean()
        for j, d in enumerate(local):
            backend.load(base)
            backend.load(heads[j])
            backend.train("all", d.x_train, d.y_train, epochs=1, batch_size=BATCH, lr=LR, seed=(SEED, round_, 0))
            mean.add(backend.read(shared_names), len(d.y_train))
            heads[j] = backend.read(local_names)
        base = mean.result()
    return base


def start_coordinator(artifacts: Path, broker_url: str, state_dir: Path, fleet: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "fedper.coordinator.cli", "--artifacts", str(artifacts), "--fleet", fleet,
         "--rounds", str(ROUNDS), "--min-clients", "2", "--round-timeout", "60", "--state-dir", str(state_dir),
         "--broker", broker_url],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )


def agent_config(artifacts: Path, data: Path, broker_url: str, fleet: str, j: int, tmp_path: Path) -> AgentConfig:
    return AgentConfig(artifacts=artifacts, data=data, broker=broker_url, fleet=fleet, client_id=f"dev{j}",
                       state_dir=tmp_path / f"state{j}", batch_size=BATCH, lr=LR, seed=SEED, backend="ort")


def run_fleet(coordinator: subprocess.Popen, agents: list[Agent], logs: list[str]) -> None:
    """Run the agents in threads until the coordinator has finished its rounds."""
    stop = threading.Event()
    threads = [threading.Thread(target=agent.run, args=(stop,), daemon=True) for agent in agents]
    for t in threads:
        t.start()
    try:
        _, err = coordinator.communicate(timeout=90)
        assert coordinator.returncode == 0, err
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "\n".join(logs)
    finally:
        stop.set()
        coordinator.kill()


def test_two_agents_two_rounds_match_an_independent_computation(tmp_path: Path, artifacts: Path, mosquitto) -> None:
    data = device_data(tmp_path)
    coordinator_dir = tmp_path / "coordinator"
    coordinator = start_coordinator(artifacts, mosquitto.url, coordinator_dir, "parity")
    logs: list[str] = []
    agents = [Agent(agent_config(artifacts, path, mosquitto.url, "parity", j, tmp_path), log=logs.append)
              for j, path in enumerate(data)]
    run_fleet(coordinator, agents, logs)

    final = load_file(str(coordinator_dir / "final.safetensors"))
    expected = reference_base(artifacts, data, tmp_path)
    assert set(final) == set(expected)
    gaps = {n: float(np.linalg.norm(final[n] - expected[n]) / max(np.linalg.norm(expected[n]), 1e-12)) for n in final}
    assert max(gaps.values()) < 1e-4, sorted(gaps.items(), key=lambda kv: -kv[1])[:3]
    initial = open_backend("ort", artifacts, check_artifacts(artifacts)).read(list(final))
    assert max(float(np.abs(final[n] - initial[n]).max()) for n in final) > 1e-3  # the rounds did train

    rounds = [json.loads(line) for line in (coordinator_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["participants"] for r in rounds] == [2, 2] and [r["n_samples"] for r in rounds] == [32, 32]
    assert all(a.final_accuracy is not None for a in agents), "\n".join(logs)
    assert all(a.state.load(a.manifest).round == ROUNDS for a in agents)  # the head survives on disk
    assert any("samples/s" in line and "peak RSS" in line for line in logs)


def test_an_agent_killed_after_saving_rejoins_and_resends(tmp_path: Path, artifacts: Path, mosquitto) -> None:
    """dev1 trained round 1 and saved its state, then died before publishing. Restarted, it
    restores its head, sends the saved update for the open round 1, and goes on to round 2."""
    data = device_data(tmp_path)
    configs = [agent_config(artifacts, path, mosquitto.url, "restart", j, tmp_path) for j, path in enumerate(data)]
    Agent(configs[1], log=lambda line: None).train_round(1)
    coordinator_dir = tmp_path / "coordinator"
    coordinator = start_coordinator(artifacts, mosquitto.url, coordinator_dir, "restart")
    logs: list[str] = []
    agents = [Agent(config, log=logs.append) for config in configs]
    run_fleet(coordinator, agents, logs)
    assert any("restored the head of round 1" in line for line in logs)
    assert any("round 1: already trained (before a restart" in line for line in logs)
    rounds = [json.loads(line) for line in (coordinator_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["participants"] for r in rounds] == [2, 2]
    assert agents[1].state.load(agents[1].manifest).round == ROUNDS


def test_agents_ride_out_a_broker_restart(tmp_path: Path, artifacts: Path, mosquitto) -> None:
    """The broker goes away after the first update of round 1 (losing its retained messages);
    agents reconnect with backoff and the run still completes with both devices in every round."""
    data = device_data(tmp_path)
    coordinator_dir = tmp_path / "coordinator"
    coordinator = start_coordinator(artifacts, mosquitto.url, coordinator_dir, "outage")
    logs: list[str] = []
    agents = [Agent(agent_config(artifacts, path, mosquitto.url, "outage", j, tmp_path), log=logs.append)
              for j, path in enumerate(data)]

    def restart_after_first_update() -> None:
        deadline = time.monotonic() + 60
        while not any(line.startswith("round 1:") for line in logs) and time.monotonic() < deadline:
            time.sleep(0.02)
        mosquitto.restart()

    restarter = threading.Thread(target=restart_after_first_update, daemon=True)
    restarter.start()
    run_fleet(coordinator, agents, logs)
    restarter.join(5)
    assert any("lost the broker" in line for line in logs)
    rounds = [json.loads(line) for line in (coordinator_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["participants"] for r in rounds] == [2, 2]
    assert all(a.final_accuracy is not None for a in agents)


PARITY_SEED, PARITY_LR, PARITY_BATCH = 5, 0.01, 32  # 32 images per device: one SGD step per round
BASE_BOUND = 1e-2  # measured 1.2e-3 .. 5.1e-3 over six run seeds: see the test


def emulated_fleet(per_class: int, test_per_class: int, *, lr: float, batch_size: int):
    """An emulated 2-client FedPer fleet on real CIFAR-10 images (client 0: classes 0-1, client 1:
    classes 2-3), and each client's uint8 (x_train, y_train, x_test, y_test) in the fleet's order."""
    import torch
    from test_emulate_cifar import decode_subset

    from fedper.data import to_float_nchw
    from fedper.emulate.data import FleetData
    from fedper.emulate.fleet import Fleet, FleetConfig
    from fedper.models import IMAGENET_MEAN, IMAGENET_STD

    x, y = decode_subset("train", per_class + test_per_class)
    arrays, clients, start = [], [], 0
    for classes in ((0, 1), (2, 3)):
        picked = [np.flatnonzero(y == c) for c in classes]
        train = np.concatenate([p[:per_class] for p in picked])
        test = np.concatenate([p[per_class:] for p in picked])
        arrays.append((x[train], y[train], x[test], y[test]))
        clients.append((torch.arange(start, start + len(train)),
                        torch.arange(start + len(train), start + len(train) + len(test))))
        start += len(train) + len(test)
    images = np.concatenate([a for xtr, _, xte, _ in arrays for a in (xtr, xte)])
    labels = np.concatenate([a for _, ytr, _, yte in arrays for a in (ytr, yte)])
    config = FleetConfig(model="mobilenet_v1", width=0.25, algorithm="fedper", kp=1, local_epochs=1,
                         batch_size=batch_size, lr=lr, seed=PARITY_SEED, engine="sequential")
    # normalized as emulate.data.load_fleet_data does; the agents use the manifest's mean/std
    x = torch.from_numpy(to_float_nchw(images, IMAGENET_MEAN, IMAGENET_STD))
    fleet = Fleet(config, FleetData(x, torch.from_numpy(labels), clients, list(CLASSES)))
    return fleet, arrays


def parity_gaps(
    tmp_path: Path, broker_url: str, *, lr: float, batch_size: int, per_class: int = 16
) -> dict[str, float]:
    """Run the emulator and two ORT agents (through the broker and the coordinator) from the same
    data, initial weights (exported from the emulator's model), seeds (device j runs with
    --seed client_seed(run_seed, j)) and batch order, and measure how far the final bases differ:
    "base" relative to the whole base (all shared tensors as one vector), "tensor" the largest
    per-tensor relative gap, "update" the gap of the trainable tensors' updates relative to the
    emulator's update, "agents_vs_exact" and "emulator_vs_exact" the agents' and the emulator's
    update against the same emulated run in float64, "moved" the agents' update norm over the
    emulator's."""
    from fedper.batches import client_seed
    from fedper.emulate.fleet import Fleet
    from fedper.export.exporter import export_artifacts

    fleet, arrays = emulated_fleet(per_class, test_per_class=2, lr=lr, batch_size=batch_size)
    artifacts = tmp_path / "export"
    export_artifacts(artifacts, model="mobilenet_v1", kp=1, num_classes=4, input_size=32, width=0.25,
                     algorithm="fedper", classes=CLASSES, state_dict=fleet.initial)
    paths = []
    for j, (x_train, y_train, x_test, y_test) in enumerate(arrays):
        paths.append(tmp_path / f"device{j}.npz")
        np.savez(paths[-1], x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test, classes=np.array(CLASSES))
    coordinator_dir = tmp_path / "coordinator"
    coordinator = start_coordinator(artifacts, broker_url, coordinator_dir, "emulated")
    logs: list[str] = []
    agents = [Agent(AgentConfig(artifacts=artifacts, data=path, broker=broker_url, fleet="emulated",
                                client_id=f"dev{j}", state_dir=tmp_path / f"state{j}", batch_size=batch_size,
                                lr=lr, seed=client_seed(PARITY_SEED, j), backend="ort"), log=logs.append)
              for j, path in enumerate(paths)]
    run_fleet(coordinator, agents, logs)

    def emulate(fleet) -> dict[str, np.ndarray]:
        state = fleet.init()
        for _ in range(ROUNDS):
            state, _ = fleet.run_round(state)
        return {n: t.numpy() for n, t in state.shared.items()}

    emulated = emulate(fleet)
    # the same run in float64, as the exact answer both float32 runs approximate
    exact_fleet = Fleet(fleet.config, dataclasses.replace(fleet.data, x=fleet.data.x.double()))
    exact_fleet.model.double()
    exact_fleet.initial = {n: t.double() for n, t in fleet.initial.items()}
    exact = emulate(exact_fleet)
    final = load_file(str(coordinator_dir / "final.safetensors"))
    initial = {n: t.numpy() for n, t in fleet.initial.items()}
    assert set(final) == set(emulated)
    trainable = [n for n in final if fleet.manifest.spec(n).trainable]

    def whole(tensors: dict[str, np.ndarray], names) -> np.ndarray:
        return np.concatenate([tensors[n].ravel().astype(np.float64) for n in sorted(names)])

    def update(tensors: dict[str, np.ndarray], names=trainable) -> np.ndarray:
        return whole(tensors, names) - whole(initial, names)

    def gap(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

    return {
        "base": gap(whole(final, final), whole(emulated, final)),
        "tensor": max(gap(final[n], emulated[n]) for n in final),
        "update": gap(update(final), update(emulated)),
        "agents_vs_exact": gap(update(final), update(exact)),
        "emulator_vs_exact": gap(update(emulated), update(exact)),
        "moved": float(np.linalg.norm(update(final)) / np.linalg.norm(update(emulated))),
    }


@pytest.mark.skipif(not Path(__file__).resolve().parents[1].parent.joinpath("shared/data/cifar10-jpeg.npz").exists(),
                    reason="real CIFAR-10 pack not found at ../shared/data/cifar10-jpeg.npz")
def test_two_agents_through_the_broker_match_the_emulator(tmp_path: Path, mosquitto) -> None:
    """Two ORT agents through Mosquitto and the coordinator end where `fedper-emulate` (PyTorch)
    ends from the same CIFAR-10 images, initial weights, seeds and batch order, as closely as
    float32 allows for this network after two rounds, which is far from 1e-4.

    Measured (MobileNet-v1 x0.25, 32x32, 4 classes, 32 real images per device, 2 rounds; base =
    all shared tensors as one vector; update = the trainable part's change from the start):
    lr 0.01, batch 32 (this test; one step per device and round), run seeds 5, 1, 2, 3, 4, 6:
    base gap 3.8e-3, 3.7e-3, 1.2e-3, 2.4e-3, 5.1e-3, 2.7e-3; update gap 0.50, 0.68, 0.23, 0.64,
    0.92, 0.61; per tensor up to 1.6 (zero-initialized BatchNorm biases hold nothing but their
    update). lr 0.01, batch 16: base 1.1e-2, update 1.1. lr 1e-3: base 5e-5 .. 3.5e-4, update
    0.09 .. 0.53. lr 1e-4: base 9e-6 .. 1.7e-5, update 0.13 .. 0.22, but there the update is
    itself ~5e-5 of the base, so "within 1e-4 of the base" would pass without any training.

    Why: float32, not the agents. The emulator in float32 against the same run in float64 is
    1.7e-2 of the update off after round 1 (any lr) and 0.45 .. 0.77 after round 2; the agents
    are 0.29 .. 0.96 off float64 (ratio to the emulator's 0.46 .. 1.25). One step from one state
    is accurate (ORT vs PyTorch 5e-4 of the update, each ~1e-2 from float64, test_edge), and so is
    round 2 from one state (0.8% f32 vs f64), but this randomly initialized BatchNorm network is
    so sensitive to its weights that round 1's round-off (a ~1e-5 relative perturbation of the
    weights moves round 2's update by ~4%) changes round 2's update by tens of percent.
    Forward passes and BatchNorm statistics agree to 6e-8 (lr 0), so data, normalization,
    batches and statistics match. Hence: the whole base within 1e-2, the agents no further from
    the float64 run than 1.5x the emulator is, and their update as large as the emulator's."""
    gaps = parity_gaps(tmp_path, mosquitto.url, lr=PARITY_LR, batch_size=PARITY_BATCH)
    assert gaps["base"] < BASE_BOUND, gaps
    assert gaps["agents_vs_exact"] < 1.5 * gaps["emulator_vs_exact"], gaps  # as accurate as the emulator
    assert 0.5 < gaps["moved"] < 2, gaps  # the agents trained as far as the emulator
