"""Asynchronous rounds (--mode async) through a real Mosquitto: a coordinator process killed with SIGKILL at
random points and restarted, with scripted devices of mixed speeds (fast, slow, one that vanishes and comes
back), loses no update and folds none twice; real agents (onnxruntime-training) run a few versions.

The scripted devices are paho clients speaking protocol v1 (fedper.wire) with numpy weights: device j trains
on round v's model by adding its own delta_j, so every version is known from metrics.jsonl's record of which
updates it folded (and how stale each was), computed here independently."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file
from test_coordinator_live import wait_for, write_artifacts
from vectors.make_vectors import tiny_manifest, tiny_tensors

from fedper.manifest import Manifest
from fedper.mqtt import connect_async, make_client, parse_broker_url
from fedper.payload import decode_shared, encode_shared, max_blob_size
from fedper.wire import ErrorMessage, Reassembler, Register, RoundInfo, Topics, UpdateMeta, WireError, chunk

pytestmark = pytest.mark.mosquitto
FLEET = "async"
TOPICS = Topics(FLEET)


class AsyncDevice:
    """Trains (sleeps `train_s`, adds `delta`) on each new round it sees, one at a time, and sends the update
    tagged with the round it trained on even if a newer one opened meanwhile; when RoundInfo of a round it
    has seen is published again (a coordinator restart), it sends its last update again (section 8.2).
    `vanish_after`: after that many updates it disconnects without a word and comes back `away_s` later."""

    def __init__(self, url: str, name: str, n: int, delta: float, train_s: float, manifest: Manifest, *,
                 vanish_after: int | None = None, away_s: float = 2.0) -> None:
        self.url, self.name, self.n, self.delta, self.train_s = url, name, n, delta, train_s
        self.manifest, self.vanish_after, self.away_s = manifest, vanish_after, away_s
        self.sent: dict[int, float] = {}  # round trained on -> when first sent
        self.errors: list[ErrorMessage] = []
        self.info: RoundInfo | None = None
        self.blobs: dict[str, bytes] = {}
        self.busy = False
        self.last: tuple[int, bytes] | None = None  # the last update: its round and blob
        self.lock = threading.Lock()
        self._reassembler = Reassembler(max_blob_size(manifest))
        self.client = self._client()

    def _client(self):  # type: ignore[no-untyped-def]
        client = make_client(f"dev-{self.name}", will=(TOPICS.presence(self.name), b"offline"))
        client.on_connect = self._on_connect
        client.on_message = self._on_message
        connect_async(client, parse_broker_url(self.url))
        return client

    def _on_connect(self, client, userdata, flags, reason, props) -> None:  # type: ignore[no-untyped-def]
        client.subscribe([(TOPICS.round, 1), (f"{TOPICS.base}/model/#", 1), (TOPICS.error(self.name), 1)])
        client.publish(TOPICS.presence(self.name), b"online", qos=1, retain=True)
        client.publish(TOPICS.register(self.name), Register(self.n, self.manifest.base_digest, "async/1").encode(),
                       qos=1, retain=True)

    def _on_message(self, client, userdata, msg) -> None:  # type: ignore[no-untyped-def]
        if msg.topic == TOPICS.error(self.name):
            self.errors.append(ErrorMessage.decode(msg.payload))
            return
        with self.lock:
            if msg.topic == TOPICS.round:
                info = RoundInfo.decode(msg.payload)
                again = self.info is not None and info.round == self.info.round and info.state == "open"
                self.info = info
                if again and self.last and self.last[0] >= info.round - (info.max_staleness or 0):
                    self._publish(*self.last, suffix=f"again{time.monotonic_ns()}")
            elif msg.payload:
                try:
                    blob = self._reassembler.add("coordinator", bytes(msg.payload))
                except WireError:
                    return
                if blob is not None:
                    self.blobs[blob.blob_id] = blob.data
            self._maybe_train()

    def _maybe_train(self) -> None:
        info = self.info
        if self.busy or info is None or info.state != "open" or info.round in self.sent:
            return
        if info.blob_id not in self.blobs:
            return
        self.busy = True
        base = decode_shared(self.manifest, self.blobs[info.blob_id])
        threading.Timer(self.train_s, self._trained, (info.round, base)).start()

    def _trained(self, round_: int, base: dict[str, np.ndarray]) -> None:
        update = {k: (v + np.float32(self.delta)).astype(v.dtype) for k, v in base.items()}
        with self.lock:
            self.last = (round_, encode_shared(self.manifest, update))
            self.sent[round_] = time.monotonic()
            self._publish(*self.last)
            self.busy = False
            if self.vanish_after is not None and len(self.sent) == self.vanish_after:
                self.client.disconnect()
                self.client.loop_stop()
                threading.Timer(self.away_s, self._come_back).start()
                return
            self._maybe_train()

    def _come_back(self) -> None:
        with self.lock:
            self.info = None  # learns the open round again from the retained RoundInfo
            self.client = self._client()

    def _publish(self, round_: int, blob: bytes, suffix: str = "") -> None:
        meta = UpdateMeta(round_, self.n, self.manifest.base_digest, {"accuracy": 0.5})
        for frame in chunk(blob, 200, f"r{round_}-{self.name}{suffix}", meta.to_dict()):
            self.client.publish(TOPICS.update(self.name), frame, qos=1)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def replay(initial: dict[str, np.ndarray], records: list[dict[str, Any]], devices: dict[str, AsyncDevice],
           staleness_a: float = 0.5) -> dict[int, dict[str, np.ndarray]]:
    """Every version from the updates metrics.jsonl says it folded: v + sum n_j w(s_j) delta_j / sum n_j, each
    delta the device's float32 update of the model it trained on minus that model, w(s) = (1 + s)^-a."""
    versions = {1: initial}
    for record in records:
        r = record["round"]
        assert record["buffer"]["version"] == r + 1
        total, step = 0.0, {k: np.zeros(v.shape) for k, v in initial.items()}
        for update, s in zip(record["buffer"]["updates"], record["buffer"]["staleness"], strict=True):
            name, trained_on = update.split("@")
            device, v = devices[name], int(trained_on)
            assert s == r - v
            for k, base in versions[v].items():
                delta = (base + np.float32(device.delta)).astype(np.float32).astype(np.float64) - base
                step[k] += device.n * (1 + s) ** -staleness_a * delta
            total += device.n
        versions[r + 1] = {k: (v.astype(np.float64) + step[k] / total).astype(np.float32)
                           for k, v in versions[r].items()}
    return versions


def coordinator(artifacts: Path, state: Path, url: str, *args: str) -> subprocess.Popen[bytes]:
    log = open(state.parent / "coordinator.log", "ab")  # noqa: SIM115 (the child keeps it)
    return subprocess.Popen([sys.executable, "-m", "fedper.coordinator.cli", "--artifacts", str(artifacts),
                             "--fleet", FLEET, "--state-dir", str(state), "--broker", url, *args],
                            stdout=log, stderr=subprocess.STDOUT)


def versions_released(state: Path) -> int:
    path = state / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_kill9_at_random_points_loses_nothing_and_folds_nothing_twice(mosquitto, tmp_path: Path) -> None:
    manifest, initial = tiny_manifest(), tiny_tensors()
    artifacts = write_artifacts(tmp_path / "export", manifest, initial)
    state = tmp_path / "state"
    rounds, k, window = 14, 2, 3
    args = ("--mode", "async", "--rounds", str(rounds), "--buffer-size", str(k), "--max-staleness", str(window),
            "--round-timeout", "30", "--chunk-size", "100")
    proc = coordinator(artifacts, state, mosquitto.url, *args)
    plans = {"fast1": (10, 0.5, 0.2), "fast2": (20, -0.25, 0.3), "fast3": (15, 0.125, 0.25),
             "slow": (40, 1.0, 1.5)}
    devices = {name: AsyncDevice(mosquitto.url, name, n, delta, train_s, manifest)
               for name, (n, delta, train_s) in plans.items()}
    devices["gone"] = AsyncDevice(mosquitto.url, "gone", 30, -1.0, 0.4, manifest, vanish_after=2, away_s=3.0)
    rng = random.Random(int.from_bytes(os.urandom(4)))
    kills, log = [], tmp_path / "coordinator.log"
    try:
        for i, target in enumerate((rng.randint(1, 3), rng.randint(5, 7), rng.randint(9, 11))):
            wait_for(lambda i=i: log.read_text().count("resumed from") >= i, 90, "the restarted coordinator")
            wait_for(lambda t=target: versions_released(state) >= t, 90, f"version {target + 1}")
            time.sleep(rng.uniform(0.0, 0.4))  # anywhere: mid-upload, mid-fold, mid-commit, mid-release
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            kills.append(versions_released(state))
            proc = coordinator(artifacts, state, mosquitto.url, *args)
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
        finished_at = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
        for device in devices.values():
            device.close()
    assert log.read_text().count("resumed from") == 3
    records = [json.loads(line) for line in (state / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == list(range(1, rounds + 1))
    folded = [u for r in records for u in r["buffer"]["updates"]]
    assert all(len(r["buffer"]["updates"]) == k for r in records)
    assert len(folded) == len(set(folded)), "an update folded twice"
    saved = json.loads((state / "state.json").read_text())
    assert saved["counters"]["accepted"] == len(folded) == rounds * k  # each counted once across the kills
    assert any(s > 0 for r in records for s in r["buffer"]["staleness"]), "no stale update was folded"
    versions = replay(initial, records, devices)
    final = load_file(str(state / "final.safetensors"))
    for name, value in versions[rounds + 1].items():
        np.testing.assert_allclose(final[name], value, rtol=1e-6, atol=1e-6)
    refused = {(d.name, e.round) for d in devices.values() for e in d.errors if e.code == "stale_update"}
    for device in devices.values():  # nothing lost: each update sent while the run went on was folded or refused
        for round_, at in device.sent.items():
            if at < finished_at - 5.0 and round_ < rounds - window:
                assert f"{device.name}@{round_}" in folded or refused, (device.name, round_, kills)
    codes = {e.code for d in devices.values() for e in d.errors}
    assert codes <= {"duplicate_update", "stale_update", "late_update"}, codes


def test_stale_updates_beyond_the_window_are_refused_through_the_broker(mosquitto, tmp_path: Path) -> None:
    """A device far slower than the versions go is answered stale_update; the others' versions go on."""
    manifest, initial = tiny_manifest(), tiny_tensors()
    artifacts = write_artifacts(tmp_path / "export", manifest, initial)
    state = tmp_path / "state"
    proc = coordinator(artifacts, state, mosquitto.url, "--mode", "async", "--rounds", "10", "--buffer-size", "1",
                       "--max-staleness", "1", "--round-timeout", "30")
    devices = {"quick": AsyncDevice(mosquitto.url, "quick", 10, 0.5, 0.5, manifest),
               "snail": AsyncDevice(mosquitto.url, "snail", 10, 2.0, 2.5, manifest)}
    try:
        assert proc.wait(timeout=90) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        for device in devices.values():
            device.close()
    assert "stale_update" in {e.code for e in devices["snail"].errors}
    records = [json.loads(line) for line in (state / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 10 and all(max(r["buffer"]["staleness"]) <= 1 for r in records)
    versions = replay(initial, records, devices)
    final = load_file(str(state / "final.safetensors"))
    for name, value in versions[11].items():
        np.testing.assert_allclose(final[name], value, rtol=1e-6, atol=1e-6)
    assert not math.isnan(float(final["stem.bias"][0]))


def test_real_agents_run_asynchronous_versions(tmp_path: Path, tiny_artifacts: Path, mosquitto) -> None:
    """Four onnxruntime-training agents (one with five times the data: slower), three training at once, a
    version every 2 updates: every version holds 2 distinct updates of invited devices, devices train again
    on later versions, and every agent ends with the final model."""
    from helpers.processes import run_fleet

    from fedper.data import load_digits
    from fedper.edge.agent import Agent, AgentConfig

    rounds, state = 4, tmp_path / "coordinator"
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "fedper.coordinator.cli", "--artifacts", str(tiny_artifacts), "--fleet", "alive",
         "--mode", "async", "--rounds", str(rounds), "--buffer-size", "2", "--clients-per-round", "3",
         "--max-staleness", "3", "--round-timeout", "60", "--state-dir", str(state), "--broker", mosquitto.url],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ds = load_digits(32).train
    pool = np.flatnonzero(ds.y < 4)
    agents, logs = [], {}
    for j, count in enumerate((16, 16, 16, 80)):
        idx = pool[100 * j: 100 * j + count]
        data = tmp_path / f"device{j}.npz"
        np.savez(data, x_train=ds.x[idx], y_train=ds.y[idx], classes=np.array(("0", "1", "2", "3")))
        logs[f"dev{j}"] = []
        agents.append(Agent(AgentConfig(artifacts=tiny_artifacts, data=data, broker=mosquitto.url, fleet="alive",
                                        client_id=f"dev{j}", state_dir=tmp_path / f"dev{j}", batch_size=8, lr=0.05,
                                        reconnect_spread_s=1.0), log=logs[f"dev{j}"].append))
    run_fleet(coordinator, agents, 150, logs)
    records = [json.loads(line) for line in (state / "metrics.jsonl").read_text().splitlines()]
    assert [r["buffer"]["version"] for r in records] == list(range(2, rounds + 2))
    folded = [u for r in records for u in r["buffer"]["updates"]]
    assert all(len(r["buffer"]["updates"]) == 2 for r in records) and len(folded) == len(set(folded))
    assert all(int(u.split("@")[1]) <= r["round"] for r in records for u in r["buffer"]["updates"])
    counters = json.loads((state / "state.json").read_text())["counters"]
    assert counters["accepted"] == 2 * rounds and counters.get("not_invited", 0) == 0, counters
    trained = {name: sum("served accuracy" in line for line in lines) for name, lines in logs.items()}
    assert max(trained.values()) >= 2, trained  # a device trained again on a later version
    assert all(agent.final_accuracy is not None for agent in agents), logs
    final = load_file(str(state / "final.safetensors"))
    initial = load_file(str(tiny_artifacts / "base.safetensors"))
    assert all(np.isfinite(v).all() for v in final.values())
    assert max(float(np.abs(final[n] - initial[n]).max()) for n in final) > 1e-3  # the versions did train
