"""Two ORT agents and the coordinator through a real Mosquitto: a 2-round FedPer run.

The final aggregated base must equal an independent in-process computation (same data, split,
seeds and batch order; no MQTT, no coordinator, no state dir) within 1e-4 relative.
"""

from __future__ import annotations

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
