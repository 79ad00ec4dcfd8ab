"""The device around the engine: a real agent (the tiny export, real digit scans, onnxruntime-training or
torch) doing the jobs the engine asks for, driven with hand-built frames (tests/test_edge_engine.py's), and
through a real Mosquitto the service's loop, which keeps serving while a job is out.

A round's update is what training the round's model by hand gives; a restarted device resends the update it
saved; a finished run writes the served model and its accuracy; a FedBABU device reports and serves a
fine-tuned copy, as the emulator evaluates it; --only-when's command runs for real.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers.recording import Recorder
from safetensors.numpy import save as st_save
from test_edge_engine import Frame, chunk_frames, read_frame, round_info

from fedper.checkpoint import read_checkpoint
from fedper.data import load_digits
from fedper.edge.agent import Agent, AgentConfig
from fedper.edge.eligibility import Conditions
from fedper.edge.engine import Phase
from fedper.edge.service import run_agent
from fedper.edge.state import FINAL_FILE, SERVED_FILE
from fedper.wire import Outgoing

FLEET, DEVICE = "lab", "dev0"
BASE = f"fedper/v1/{FLEET}"
UPDATE_TOPIC = f"{BASE}/update/{DEVICE}"
CHUNK = 64 * 1024


class Device:
    """An agent and everything it logged."""

    def __init__(self, config: AgentConfig, **options: object) -> None:
        self.logs: list[str] = []
        self.agent = Agent(config, log=self.logs.append, **options)

    def feed(self, messages: list[Frame]) -> list[Outgoing]:
        out: list[Outgoing] = []
        for topic, payload in messages:
            out += self.agent.handle(topic, payload)
        return out

    def open_round(self, round_: int, tensors: dict[str, np.ndarray], **fields: object) -> list[Outgoing]:
        """RoundInfo and then the model's chunks, as they usually arrive."""
        blob = st_save(tensors)
        return self.feed([round_info(blob, round_, self.agent.manifest.base_digest, chunk_size=CHUNK, **fields),
                          *chunk_frames(blob, str(fields.get("blob_id", f"r{round_}")), round_, CHUNK)])

    def tensors(self) -> dict[str, np.ndarray]:
        """Every tensor of the model as it is now: the shared ones and the head."""
        return self.agent.backend.read(self.agent.manifest.names())


def sent_update(out: list[Outgoing]) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta, tensors) of the one update among `out`, reassembled by hand."""
    from safetensors.numpy import load

    frames = sorted((read_frame(m.payload) for m in out if m.topic == UPDATE_TOPIC), key=lambda f: f[0]["index"])
    assert frames and len(frames) == frames[0][0]["count"]
    return frames[0][0]["meta"], load(b"".join(data for _, data in frames))


@pytest.fixture
def device_data(tmp_path: Path) -> Path:
    """20 real digit scans of classes 0..3 (16 train, 4 test)."""
    ds = load_digits(32).train
    idx = np.flatnonzero(ds.y < 4)[:20]
    path = tmp_path / "digits.npz"
    np.savez(path, x_train=ds.x[idx], y_train=ds.y[idx], classes=np.array(("0", "1", "2", "3")))
    return path


@pytest.fixture
def make_device(tiny_artifacts: Path, device_data: Path, tmp_path: Path) -> Callable[..., Device]:
    """make_device(state="state", options={...}, **config) -> a Device (options: the Agent's conditions and
    clock); the same state name is the same device restarted."""

    def make(state: str = "state", options: dict | None = None, **config: object) -> Device:
        return Device(AgentConfig(artifacts=tiny_artifacts, data=device_data, broker="mqtt://127.0.0.1:1",
                                  fleet=FLEET, client_id=DEVICE, state_dir=tmp_path / state, batch_size=8, lr=0.05,
                                  backend="ort", **config), **(options or {}))

    return make


@pytest.fixture
def models(make_device: Callable[..., Device]) -> Callable[[int], dict[str, np.ndarray]]:
    """models(k) -> the coordinator's model of round k: the export's shared tensors, scaled by 1 + k/100."""
    agent = make_device("models").agent
    initial = agent.backend.read(agent.manifest.names(shared=True))
    return lambda k: {n: (x * np.float32(1 + k / 100)).astype(x.dtype) for n, x in initial.items()}


def test_a_round_trains_from_the_rounds_model_saves_and_sends_only_the_shared_tensors(make_device, models) -> None:
    device = make_device()
    agent = device.agent
    meta, update = sent_update(device.open_round(1, models(1)))
    assert meta["round"] == 1 and meta["n_samples"] == 16 and 0 <= meta["metrics"]["accuracy"] <= 1
    assert sorted(update) == sorted(agent.manifest.names(shared=True))  # no head tensor on the wire

    by_hand = make_device("by-hand").agent  # the same device's data and seeds, the round's model loaded by hand
    by_hand.backend.load(models(1))
    expected = by_hand.train_round(1).update
    assert all(np.array_equal(update[n], expected[n]) for n in expected)
    saved = agent.state.load(agent.manifest)  # on disk before it was sent
    assert saved.round == 1 and all(np.array_equal(saved.update[n], update[n]) for n in update)


def test_a_restarted_device_resends_the_update_it_saved(make_device, models) -> None:
    _, first = sent_update(make_device().open_round(1, models(1)))
    restarted = make_device()  # the same state dir: killed after saving, before the coordinator had the update
    assert any("restored the head of round 1" in line for line in restarted.logs)
    meta, update = sent_update(restarted.open_round(1, models(1)))
    assert meta["round"] == 1 and all(np.array_equal(update[n], first[n]) for n in first)  # not retrained
    assert not any("served accuracy" in line for line in restarted.logs)


def test_keep_updates_keeps_each_rounds_update_as_sent(make_device, models, tmp_path: Path) -> None:
    """--keep-updates: updates/r<k>.safetensors holds round k's update bit for bit as it went on the wire (the
    chaos soak's checker compares the released models with these), private to the device; without it, none."""
    device = make_device(keep_updates=True)
    sent = {k: sent_update(device.open_round(k, models(k)))[1] for k in (1, 2)}
    for k, update in sent.items():
        path = tmp_path / "state" / "updates" / f"r{k}.safetensors"
        kept, meta = read_checkpoint(path)
        assert meta["round"] == k and meta["n_samples"] == 16 and sorted(kept) == sorted(update)
        assert all(np.array_equal(kept[n], update[n]) for n in update)
        assert path.stat().st_mode & 0o077 == 0
    assert not any(np.array_equal(sent[1][n], sent[2][n]) for n in sent[1])
    make_device("plain").open_round(1, models(1))
    assert not (tmp_path / "plain" / "updates").exists()


def test_the_finished_run_writes_the_served_model_and_its_accuracy(make_device, models, tmp_path: Path) -> None:
    device = make_device()
    sent_update(device.open_round(1, models(1)))
    head = device.agent.backend.read(device.agent.manifest.names(shared=False))
    assert device.open_round(3, models(3), state="finished", blob_id="final") == []
    agent = device.agent
    assert agent.engine.done and agent.final_accuracy is not None and 0 <= agent.final_accuracy <= 1
    record = json.loads((tmp_path / "state" / FINAL_FILE).read_text())
    assert record["rounds"] == 3 and record["accuracy"] == agent.final_accuracy
    now = device.tensors()
    assert all(np.array_equal(now[n], x) for n, x in models(3).items())  # the final base, served with
    assert all(np.array_equal(now[n], x) for n, x in head.items())  # the device's own head
    served, meta = read_checkpoint(tmp_path / "state" / SERVED_FILE)  # saved as served, with what it measured
    assert meta == record and set(served) == set(now) and all(np.array_equal(served[n], now[n]) for n in now)


def test_a_command_condition_is_run_for_real(make_device, models, tmp_path: Path) -> None:
    allowed = tmp_path / "unmetered"
    device = make_device(options={"conditions": Conditions((f"command:test -e {allowed}",))})
    assert device.open_round(1, models(1)) == []  # offline already: nothing to say, nothing trained
    assert device.agent.saved is None and any("not eligible (command:" in line for line in device.logs)
    allowed.touch()
    out = device.feed([round_info(st_save(models(1)), 1, device.agent.manifest.base_digest, chunk_size=CHUNK)])
    assert [m.payload for m in out if "/presence/" in m.topic] == [b"online"] and sent_update(out)[0]["round"] == 1


@pytest.mark.mosquitto
def test_the_service_keeps_serving_while_a_job_is_out(tiny_artifacts: Path, device_data: Path, tmp_path: Path,
                                                      mosquitto) -> None:
    """--only-when's command blocks until a file appears: while that check runs in its thread, the loop
    connects, says offline and registers through a real Mosquitto; the file appears and it says online."""
    go = tmp_path / "go"
    recorder = Recorder(mosquitto.host, mosquitto.port, f"{BASE}/#")
    config = AgentConfig(artifacts=tiny_artifacts, data=device_data, broker=mosquitto.url, fleet=FLEET,
                         client_id=DEVICE, state_dir=tmp_path / "state", backend="ort", reconnect_spread_s=1.0,
                         only_when=(f"command:while [ ! -e {go} ]; do sleep 0.05; done",))
    agent = Agent(config, log=lambda line: None, conditions=Conditions(config.only_when, command_timeout_s=60))
    stop = threading.Event()
    thread = threading.Thread(target=run_agent, args=(agent, stop), daemon=True)
    thread.start()
    try:
        def seen(topic: str) -> list[bytes]:
            return [payload for t, payload in recorder.snapshot() if t == f"{BASE}/{topic}/{DEVICE}"]

        deadline = time.monotonic() + 20
        while not seen("register") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen("register") and seen("presence") == [b"offline"]  # announced while the check is blocked
        assert agent.engine.phase is Phase.CHECKING and not go.exists()
        go.touch()
        while seen("presence")[-1:] != [b"online"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen("presence") == [b"offline", b"online"]
    finally:
        stop.set()
        go.touch()
        thread.join(20)
        recorder.close()
    assert not thread.is_alive()


# ------------------------------------------------------------ FedBABU: a fine-tuned copy is evaluated and served


@pytest.fixture
def babu(tiny_export, device_data: Path, tmp_path: Path) -> Callable[..., Device]:
    """babu(state="babu", **config) -> a FedBABU device (MobileNet-v1 x0.25, K_P=1, the head frozen at its init)."""
    artifacts = tiny_export(algorithm="fedbabu", kp=1)

    def make(state: str = "babu", **config: object) -> Device:
        options = {"backend": "ort", "seed": 3, **config}
        return Device(AgentConfig(artifacts=artifacts, data=device_data, broker="mqtt://127.0.0.1:1", fleet=FLEET,
                                  client_id=DEVICE, state_dir=tmp_path / state, batch_size=8, lr=0.05, **options))

    return make


def by_hand(device: Device, model: dict[str, np.ndarray], trained: str | None = None, seed: tuple[int, ...] = ()):
    """A fresh ORT backend of the same export holding `model` (+ the export's head), with `trained`
    trained one epoch on the device's own data with the batch key `seed`."""
    from fedper.edge.backend import open_backend

    agent = device.agent
    backend = open_backend("ort", agent.config.artifacts, agent.manifest)
    backend.load(model)
    if trained is not None:
        backend.train(trained, agent.data.x_train, agent.data.y_train, epochs=1, batch_size=8, lr=0.05, seed=seed)
    return backend


def test_a_fedbabu_device_reports_a_fine_tuned_copy_and_trains_the_untuned_model(babu) -> None:
    device = babu()
    agent = device.agent
    initial = device.tensors()
    shared, head = agent.manifest.names(shared=True), agent.manifest.names(shared=False)
    model = {n: initial[n] for n in shared}
    meta, update = sent_update(device.open_round(1, model))

    tuned = by_hand(device, model, "all", (3, 1, 1000))  # (--seed, round, the emulator's fine-tune phase)
    accuracy, loss = tuned.evaluate(agent.data.x_test, agent.data.y_test)
    assert (meta["metrics"]["accuracy"], meta["metrics"]["loss"]) == pytest.approx((accuracy, loss), abs=1e-6)
    frozen = babu("frozen", eval_finetune_epochs=0)
    frozen_meta, frozen_update = sent_update(frozen.open_round(1, model))
    untuned = by_hand(device, model).evaluate(agent.data.x_test, agent.data.y_test)
    assert frozen_meta["metrics"]["loss"] == pytest.approx(untuned[1])
    assert abs(frozen_meta["metrics"]["loss"] - loss) > 1e-4  # the random head's evaluation is not what is reported

    # the training state is the untuned model's: the head is still its frozen init, the update is the
    # base trained from the untuned model (the same as the device that never fine-tunes sends)
    saved = agent.state.load(agent.manifest)
    assert all(np.array_equal(saved.local[n], initial[n]) for n in head)
    assert all(np.array_equal(device.tensors()[n], initial[n]) for n in head)
    trained = by_hand(device, model, "base", (3, 1, 0)).read(shared)
    assert all(np.allclose(update[n], trained[n], rtol=1e-6, atol=1e-7) for n in shared)
    assert all(np.array_equal(update[n], frozen_update[n]) for n in shared)


def test_a_finished_fedbabu_device_saves_the_fine_tuned_model_that_final_json_measured(babu, tmp_path) -> None:
    device = babu()
    agent = device.agent
    initial = device.tensors()
    model = {n: initial[n] for n in agent.manifest.names(shared=True)}
    assert device.open_round(2, model, rounds=2, state="finished", blob_id="final") == []
    record = json.loads((tmp_path / "babu" / FINAL_FILE).read_text())
    served, meta = read_checkpoint(tmp_path / "babu" / SERVED_FILE)
    assert meta == record and set(served) == set(agent.manifest.names())
    expected = by_hand(device, model, "all", (3, 3, 1000)).read(agent.manifest.names())  # the round after R = 2
    assert all(np.array_equal(served[n], expected[n]) for n in served)
    assert not all(np.array_equal(served[n], initial[n]) for n in agent.manifest.names(shared=False))
    # what the device serves, evaluated afresh, is what final.json says
    accuracy, loss = by_hand(device, served).evaluate(agent.data.x_test, agent.data.y_test)
    assert (record["accuracy"], record["loss"]) == pytest.approx((accuracy, loss), abs=1e-6)
    assert agent.state.load(agent.manifest) is None  # no round trained: nothing of the fine-tune was kept


@pytest.mark.parametrize("backend", ["ort", "torch"])
def test_the_agents_fine_tuned_evaluation_is_the_emulators(babu, backend: str) -> None:
    """The emulator's FedBABU evaluation (fedper.emulate.fleet.Fleet._evaluate: a copy trained by
    train_client on the client's batch key with PURPOSE_FINETUNE, then evaluated) of the same tensors
    and data, for emulated client j whose client_seed is the agent's --seed, equals what the agent reports."""
    import torch

    from fedper.algorithms import Phase
    from fedper.batches import PURPOSE_FINETUNE, client_seed
    from fedper.emulate.train import client_generator, train_client
    from fedper.models import build_model
    from fedper.training import evaluate, load_tensors

    run_seed, j = 7, 1
    device = babu(backend=backend, seed=client_seed(run_seed, j))
    agent = device.agent
    initial = device.tensors()
    # round 2 opens with the aggregate of round 1, which the emulator evaluates at the end of round 1
    meta, _ = sent_update(device.open_round(2, {n: initial[n] for n in agent.manifest.names(shared=True)}))

    m = agent.manifest.model
    net = build_model(m.architecture, m.num_classes, m.width, m.input_shape[1])
    load_tensors(net, {n: torch.from_numpy(x) for n, x in initial.items()})
    d = agent.data
    x, y = torch.from_numpy(np.concatenate([d.x_train, d.x_test])), torch.from_numpy(np.concatenate([d.y_train,
                                                                                                     d.y_test]))
    train_idx, test_idx = torch.arange(len(d.y_train)), torch.arange(len(d.y_train), len(y))
    # what Fleet._evaluate does for client j at the end of round 1 (its new state's round is 1)
    train_client(net, agent.manifest, (Phase("all", 1),), x, y, train_idx, local_epochs=1, batch_size=8, lr=0.05,
                 momentum=0.0, generator=client_generator(run_seed, 1, j, PURPOSE_FINETUNE))
    accuracy, loss = evaluate(net, x, y, test_idx)
    assert meta["metrics"]["accuracy"] == accuracy
    assert meta["metrics"]["loss"] == pytest.approx(loss, rel=1e-4)
