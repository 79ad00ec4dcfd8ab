"""Faults against real processes and a real Mosquitto: kill -9 agents, broker restarts, slow devices, full disks.

Already covered elsewhere (docs/reliability.md): the coordinator killed with -9 and restarted
(test_coordinator_live.py), a device that never answers (same), agents riding out a broker
restart in-process (test_agent_fleet.py).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.disk import fill
from helpers.processes import (
    Processes,
    agent_args,
    coordinator_args,
    finish,
    kill9,
    saved_state,
    write_device_data,
)
from helpers.recording import Recorder
from safetensors.numpy import load_file
from test_coordinator_live import (
    FLEET,
    Device,
    assert_model,
    expected_model,
    metrics,
    run_in_thread,
    wait_for,
    write_artifacts,
)
from vectors.make_vectors import tiny_manifest, tiny_tensors

from fedper.edge.state import TENSORS_FILE, DeviceState
from fedper.manifest import Manifest
from fedper.payload import decode_shared
from fedper.wire import decode_chunk

pytestmark = pytest.mark.mosquitto


def agent_round(state_dir: Path, manifest: Manifest) -> int | None:
    saved = DeviceState(state_dir).load(manifest) if (state_dir / TENSORS_FILE).exists() else None
    return saved.round if saved else None


def test_agents_killed_mid_upload_and_mid_training_rejoin_without_double_counting(
        mosquitto, tmp_path: Path, tiny_artifacts: Path, processes: Processes) -> None:
    """dev0 is killed -9 while its round-1 update is half published (2 KiB chunks), dev1 while it
    trains round 2. Restarted with the same command, each restores its head from its state dir, the
    rounds complete with both devices, and the final model is exactly the n_j-weighted mean of the
    two round-2 updates the devices saved: nothing lost, nothing counted twice."""
    manifest = Manifest.load(tiny_artifacts)
    data = [write_device_data(tmp_path / "d0.npz", (0, 1), 20), write_device_data(tmp_path / "d1.npz", (2, 3), 200)]
    states = [tmp_path / "dev0", tmp_path / "dev1"]
    args = [agent_args(tiny_artifacts, data[0], mosquitto.url, "faults", "dev0", states[0], "--chunk-size", "2048"),
            agent_args(tiny_artifacts, data[1], mosquitto.url, "faults", "dev1", states[1])]
    coordinator_dir = tmp_path / "coordinator"
    coordinator = processes.start("coordinator", *coordinator_args(tiny_artifacts, mosquitto.url, coordinator_dir,
                                                                   "faults", 2, 2, 60))
    dev0 = processes.start("dev0", *args[0])
    dev1 = processes.start("dev1", *args[1])
    killed = threading.Event()

    def kill_at_first_chunk(topic: str, payload: bytes) -> None:
        if not killed.is_set():
            kill9(dev0)
            killed.set()

    uploads = Recorder(mosquitto.host, mosquitto.port, "fedper/v1/faults/update/dev0", kill_at_first_chunk)
    assert killed.wait(60), "dev0 never published an update chunk"
    time.sleep(0.5)  # whatever dev0 got out before it died has reached the recorder and the coordinator
    first = decode_chunk(uploads.snapshot()[0][1])
    sent = {decode_chunk(p).index for _, p in uploads.snapshot() if decode_chunk(p).blob_id == first.blob_id}
    assert len(sent) < first.count, "the upload finished before the kill: not a mid-upload kill"
    print(f"kill -9: dev0 died after {len(sent)} of {first.count} update chunks")
    assert agent_round(states[0], manifest) == 1  # saved before publishing
    assert "dev0" not in saved_state(coordinator_dir)["round"]["folded"]  # half an update is not an update
    processes.start("dev0", *args[0])

    wait_for(lambda: (saved_state(coordinator_dir) or {}).get("round", {}).get("number") == 2, 25, "round 2")
    time.sleep(0.3)  # dev1 trains 160 samples for about 2 s
    kill9(dev1)
    assert agent_round(states[1], manifest) == 1 and "round 2:" not in processes.log("dev1")
    processes.start("dev1", *args[1])

    assert finish(coordinator, 90, "the coordinator", processes.log("coordinator")) == 0, processes.log("coordinator")
    uploads.close()
    log0, log1 = processes.log("dev0"), processes.log("dev1")
    assert "restored the head of round 1" in log0 and "round 1: already trained" in log0
    assert "restored the head of round 1" in log1 and log1.count("round 2:") == 1
    records = metrics(coordinator_dir)
    assert [r["participants"] for r in records] == [2, 2]
    assert saved_state(coordinator_dir)["counters"]["accepted"] == 4
    saved = [DeviceState(s).load(manifest) for s in states]
    assert [s.round for s in saved] == [2, 2]
    total = sum(s.n_samples for s in saved)
    expected = {n: (sum(s.n_samples * s.update[n].astype(np.float64) for s in saved) / total).astype(np.float32)
                for n in saved[0].update}
    final = load_file(str(coordinator_dir / "final.safetensors"))
    for name, value in expected.items():
        np.testing.assert_allclose(final[name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def test_broker_restart_mid_round_loses_and_doubles_nothing(mosquitto, tmp_path: Path) -> None:
    """Mosquitto (no persistence: retained messages and sessions die with it) restarts while round 2
    waits for "slow" (its round-2 update comes 3 s after the round opened); the coordinator and the devices
    reconnect, the coordinator re-announces, and the final model is the closed-form weighted mean
    with every update counted once."""
    manifest, initial = tiny_manifest(), tiny_tensors()
    thread, coordinator = run_in_thread(mosquitto.url, tmp_path, manifest, initial, rounds=3, min_clients=3,
                                        round_timeout=30)
    devices = [Device(mosquitto.url, "a", 10, 1.0, manifest), Device(mosquitto.url, "b", 30, -0.5, manifest),
               Device(mosquitto.url, "slow", 60, 0.25, manifest, delay={2: 3.0})]
    wait_for(lambda: coordinator.round.number == 2 and len(coordinator.round.folded) == 2, 30, "round 2 under way")
    mosquitto.restart()
    thread.join(40)
    for d in devices:
        d.close()
    assert not thread.is_alive()
    assert_model(tmp_path / "final.safetensors", expected_model(initial, devices, 3))
    assert [r["participants"] for r in metrics(tmp_path)] == [3, 3, 3]
    assert json.loads((tmp_path / "state.json").read_text())["counters"]["accepted"] == 9


def test_slow_device_update_for_a_closed_round_is_rejected_and_counted(mosquitto, tmp_path: Path) -> None:
    """"slow" holds its round-1 update until round 1 has closed at its deadline without it: sent in
    round 2, it is refused with late_update (answered and counted) and never aggregated; its round-2
    update is on time and counted, and round 2 closes as soon as all three answered."""
    manifest, initial = tiny_manifest(), tiny_tensors()
    thread, _ = run_in_thread(mosquitto.url, tmp_path, manifest, initial, rounds=2, min_clients=2,
                              round_timeout=2.0)
    fast = [Device(mosquitto.url, "a", 10, 1.0, manifest), Device(mosquitto.url, "b", 30, 2.0, manifest)]
    slow = Device(mosquitto.url, "slow", 60, -1.0, manifest, respond=False)
    wait_for(lambda: "r2" in slow.blobs and slow.latest.round == 2, 20, "round 2 at the slow device")
    slow.send(1, decode_shared(manifest, slow.blobs["r1"]))
    wait_for(lambda: slow.errors, 5, "the answer to the late update")
    slow.send(2, decode_shared(manifest, slow.blobs["r2"]))
    thread.join(30)
    for d in [*fast, slow]:
        d.close()
    assert not thread.is_alive()
    assert [(e.code, e.round) for e in slow.errors] == [("late_update", 2)]
    records = metrics(tmp_path)
    assert [r["devices"] for r in records] == [["a", "b"], ["a", "b", "slow"]]
    assert records[0]["collect_s"] >= 1.9 and records[1]["rejected"] == {"late_update": 1}
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["counters"]["late_update"] == 1 and state["counters"]["accepted"] == 5
    after_round_1 = expected_model(initial, fast, 1)
    slow.respond = True  # it did answer round 2
    assert_model(tmp_path / "final.safetensors", expected_model(after_round_1, [*fast, slow], 1))


def test_coordinator_disk_full_keeps_the_checkpoint_and_resumes(mosquitto, tmp_path: Path, small_fs: Path,
                                                                processes: Processes) -> None:
    """The state dir is a 4 MiB tmpfs, filled up after both devices registered: the first update's
    checkpoint fails, the coordinator exits 1 with one clear line, state.json is byte-for-byte the
    last good checkpoint. With space again the same command resumes; the broker redelivers the
    unacknowledged updates and the run ends with the exact weighted mean."""
    manifest, initial = tiny_manifest(), tiny_tensors()
    artifacts = write_artifacts(tmp_path / "export", manifest, initial)
    state = small_fs / "state"
    args = coordinator_args(artifacts, mosquitto.url, state, FLEET, 2, 2, 30)
    coordinator = processes.start("coordinator", *args)
    devices = [Device(mosquitto.url, "a", 10, 1.0, manifest, delay=1.5),
               Device(mosquitto.url, "b", 30, -2.0, manifest, delay=1.5)]
    wait_for(lambda: len((saved_state(state) or {}).get("registered", {})) == 2, 20, "both registrations")
    filler = fill(small_fs)
    checkpoint = (state / "state.json").read_bytes()
    assert finish(coordinator, 20, "the coordinator", processes.log("coordinator")) == 1
    out = processes.log("coordinator")
    assert "No space left on device" in out and "last checkpoint intact, rerun to resume" in out
    assert "Traceback" not in out
    assert (state / "state.json").read_bytes() == checkpoint
    assert not list(state.glob(".*.tmp"))
    assert decode_shared(manifest, (state / "model-r1.safetensors").read_bytes()).keys() == initial.keys()

    filler.unlink()
    resumed = processes.start("coordinator-2", *args)
    assert finish(resumed, 30, "the resumed coordinator", processes.log("coordinator-2")) == 0
    for d in devices:
        d.close()
    assert "resumed from" in processes.log("coordinator-2")
    assert [r["participants"] for r in metrics(state)] == [2, 2]
    assert_model(state / "final.safetensors", expected_model(initial, devices, 2))


def test_agent_disk_full_keeps_its_last_state_and_rejoins(mosquitto, tmp_path: Path, small_fs: Path,
                                                          tiny_artifacts: Path, processes: Processes) -> None:
    """The agent's state dir is a 4 MiB tmpfs, filled up after it saved round 1: saving round 2
    fails, the agent exits 2 with one clear line and device.safetensors is still round 1's, byte
    for byte. With space again the restarted agent restores that head and finishes the run."""
    manifest = Manifest.load(tiny_artifacts)
    state = small_fs / "dev0"
    args = agent_args(tiny_artifacts, write_device_data(tmp_path / "d0.npz", (0, 1), 20), mosquitto.url, FLEET,
                      "dev0", state)
    coordinator_dir = tmp_path / "coordinator"
    coordinator = processes.start("coordinator", *coordinator_args(tiny_artifacts, mosquitto.url, coordinator_dir,
                                                                   FLEET, 2, 2, 60))
    agent = processes.start("dev0", *args)
    helper = Device(mosquitto.url, "helper", 10, 0.0, manifest, respond=False)  # answers round 1 when told
    try:
        wait_for(lambda: "round 1:" in processes.log("dev0"), 60, "dev0 to save round 1")
        filler = fill(small_fs)
        before = hashlib.sha256((state / TENSORS_FILE).read_bytes()).hexdigest()
        helper.respond = True
        helper.send(1, decode_shared(manifest, helper.blobs["r1"]))
        assert finish(agent, 30, "the agent", processes.log("dev0")) == 2
        out = processes.log("dev0")
        assert "(disk full)" in out and "the previous state is kept" in out and "Traceback" not in out
        assert hashlib.sha256((state / TENSORS_FILE).read_bytes()).hexdigest() == before
        assert agent_round(state, manifest) == 1 and not list(state.glob(".*.tmp"))

        filler.unlink()
        processes.start("dev0", *args)
        assert finish(coordinator, 60, "the coordinator", processes.log("coordinator")) == 0
    finally:
        helper.close()
    assert processes.log("dev0").count("restored the head of round 1") == 1
    assert [r["participants"] for r in metrics(coordinator_dir)] == [2, 2]
    assert agent_round(state, manifest) == 2
