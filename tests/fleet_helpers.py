"""Shared helpers of the fault, security, privacy and load tests: real processes around a real broker.

A tiny MobileNet-v1 export (built once per session), per-device .npz data from real digits, the
coordinator and the agent as subprocesses (their output in log files, all killed at teardown),
a recorder subscribed to every topic, a small file system to fill up, and the scripted devices
of the load test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import paho.mqtt.client as mqtt
import pytest

CLASSES = ("0", "1", "2", "3")
_EXPORT: dict[str, Path] = {}


@pytest.fixture(scope="session")
def tiny_artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MobileNet-v1 x0.25, 32x32, 4 classes, FedPer K_P=1: exported once per session, whichever
    test modules import this fixture."""
    if "dir" not in _EXPORT:
        from fedper.export.exporter import export_artifacts

        out = tmp_path_factory.mktemp("tiny-export") / "export"
        export_artifacts(out, model="mobilenet_v1", kp=1, num_classes=4, input_size=32, width=0.25,
                         algorithm="fedper", classes=CLASSES)
        _EXPORT["dir"] = out
    return _EXPORT["dir"]


def saved_state(state_dir: Path) -> dict[str, Any] | None:
    """The coordinator's state.json, or None while there is none (it is replaced atomically)."""
    path = state_dir / "state.json"
    return json.loads(path.read_text()) if path.exists() else None


def write_device_data(path: Path, classes: tuple[int, ...], count: int) -> Path:
    """Real digits of the given classes (non-IID), `count` images, as the agent's .npz."""
    from fedper.data import load_digits

    ds = load_digits(32).train
    idx = np.flatnonzero(np.isin(ds.y, classes))[:count]
    np.savez(path, x_train=ds.x[idx], y_train=ds.y[idx], classes=np.array(CLASSES))
    return path


class Processes:
    """Subprocesses with their output in log files; every one is killed (SIGKILL) at teardown."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        """`python *args`; a restart under the same name appends to the same log."""
        with open(self.dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        path = self.dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    group = Processes(tmp_path)
    yield group
    group.kill_all()


def coordinator_args(artifacts: Path, url: str, state_dir: Path, fleet: str, rounds: int, min_clients: int,
                     round_timeout: float, *extra: str) -> list[str]:
    return ["-m", "fedper.coordinator.cli", "--artifacts", str(artifacts), "--fleet", fleet, "--broker", url,
            "--rounds", str(rounds), "--min-clients", str(min_clients), "--round-timeout", str(round_timeout),
            "--state-dir", str(state_dir), *extra]


def agent_args(artifacts: Path, data: Path, url: str, fleet: str, client_id: str, state_dir: Path,
               *extra: str) -> list[str]:
    return ["-m", "fedper.edge.cli", "--artifacts", str(artifacts), "--data", str(data), "--broker", url,
            "--fleet", fleet, "--client-id", client_id, "--state-dir", str(state_dir), "--batch-size", "16",
            "--lr", "0.02", "--seed", "3", *extra]


def finish(proc: subprocess.Popen[bytes], timeout: float, what: str, log: str = "") -> int:
    """The exit code of `proc`, waiting at most `timeout` seconds (then kill it and fail)."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{what} did not finish in {timeout} s:\n{log[-3000:]}") from None


def kill9(proc: subprocess.Popen[bytes]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


class Recorder:
    """A client subscribed to a filter (default `#`) recording every message it gets, in order."""

    def __init__(self, host: str, port: int, topic: str = "#",
                 on_message: Callable[[str, bytes], None] | None = None, **credentials: str) -> None:
        self.messages: list[tuple[str, bytes]] = []
        self._hook = on_message
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"recorder-{time.monotonic_ns()}")
        if credentials:
            self.client.username_pw_set(credentials["username"], credentials["password"])
        self.client.on_connect = lambda c, u, f, reason, p: c.subscribe(topic, qos=1)
        self.client.on_subscribe = lambda c, u, mid, reasons, p: self._subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect(host, port)
        self.client.loop_start()
        if not self._subscribed.wait(10):
            raise AssertionError(f"the recorder could not subscribe to {topic}")

    def _on_message(self, client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        with self._lock:
            self.messages.append((msg.topic, bytes(msg.payload)))
        if self._hook:
            self._hook(msg.topic, bytes(msg.payload))

    def snapshot(self) -> list[tuple[str, bytes]]:
        with self._lock:
            return list(self.messages)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def watch_peak_rss(proc: subprocess.Popen[bytes], interval: float = 0.05) -> Callable[[], int]:
    """Sample the process's VmHWM (peak resident set, KiB; reset by exec, unlike ru_maxrss) until it
    exits; the returned function gives the highest value seen."""
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
            except OSError:
                break
            for line in status.splitlines():
                if line.startswith("VmHWM:"):
                    peak[0] = max(peak[0], int(line.split()[1]))
            time.sleep(interval)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()

    def result() -> int:
        thread.join(5)
        return peak[0]

    return result


# ---------------------------------------------------------------- the load test's scripted devices


def device_plan(index: int) -> tuple[int, float]:
    """(n_samples, delta) of scripted device `index`: its update is base + delta, weighted n_samples."""
    return 1 + index % 5, (index % 7 - 3) / 100


def expected_mean(initial: dict[str, np.ndarray], count: int, rounds: int) -> dict[str, np.ndarray]:
    """The model after `rounds` rounds of devices 0..count-1 (device_plan), computed in closed form."""
    plans = [device_plan(i) for i in range(count)]
    total = sum(n for n, _ in plans)
    model = initial
    for _ in range(rounds):
        model = {k: (sum(n * (v + np.float32(d)).astype(np.float64) for n, d in plans) / total).astype(v.dtype)
                 for k, v in model.items()}
    return model


def scripted_devices(url: str, fleet: str, indices: list[int], timeout: float, results: Any) -> None:
    """Run devices `indices` (paho clients, one process) until the run is finished; put
    {device: rounds answered} on `results`. The target of the load test's worker processes."""
    from vectors.make_vectors import tiny_manifest

    from fedper.mqtt import connect_async, make_client, parse_broker_url
    from fedper.wire import (
        Reassembler,
        Register,
        RoundInfo,
        Topics,
        UpdateMeta,
        WireError,
        decode_tensors,
        max_shared_blob_size,
        update_frames,
    )

    manifest, topics, broker = tiny_manifest(), Topics(fleet), parse_broker_url(url)
    answered: dict[str, set[int]] = {}
    finished: set[str] = set()
    lock = threading.Lock()

    def device(index: int) -> mqtt.Client:
        name = f"load-{index}"
        n, delta = device_plan(index)
        answered[name] = set()
        reassembler = Reassembler(max_shared_blob_size(manifest))
        seen: dict[str, Any] = {"blobs": {}, "info": None}

        def on_connect(client: mqtt.Client, userdata: object, flags: object, reason: object, props: object) -> None:
            client.subscribe([(topics.round, 1), (f"{topics.base}/model/#", 1)])
            client.publish(topics.register(name), Register(n, manifest.base_digest, "load/1").encode(), qos=1,
                           retain=True)

        def on_message(client: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
            if msg.topic == topics.round:
                seen["info"] = RoundInfo.decode(msg.payload)
            elif msg.payload:
                try:
                    blob = reassembler.add("coordinator", bytes(msg.payload))
                except WireError:
                    return
                if blob is not None:
                    seen["blobs"][blob.blob_id] = blob.data
            info = seen["info"]
            if info is None or info.blob_id not in seen["blobs"]:
                return
            if info.state == "finished":
                with lock:
                    finished.add(name)
                return
            if info.round in answered[name]:
                return
            answered[name].add(info.round)
            base = decode_tensors(manifest, seen["blobs"][info.blob_id])
            update = {k: (v + np.float32(delta)).astype(v.dtype) for k, v in base.items()}
            for frame in update_frames(manifest, update, UpdateMeta(info.round, n, manifest.base_digest),
                                       f"r{info.round}-{name}"):
                client.publish(topics.update(name), frame, qos=1)

        client = make_client(f"{fleet}-{name}", protocol="5")
        client.on_connect = on_connect
        client.on_message = on_message
        connect_async(client, broker)
        return client

    clients = [device(i) for i in indices]
    deadline = time.monotonic() + timeout
    while len(finished) < len(clients) and time.monotonic() < deadline:
        time.sleep(0.05)
    for client in clients:
        client.disconnect()
        client.loop_stop()
    results.put({name: sorted(rounds) for name, rounds in answered.items()})


# ---------------------------------------------------------------- a small file system to fill up


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted for this test (root only): a disk that can really be filled."""
    mount = tmp_path / "small-fs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(directory: Path) -> Path:
    """Write a file until the file system says ENOSPC; its path (delete it to free the space)."""
    path = directory / "filler"
    with open(path, "wb", buffering=0) as f:
        try:
            while f.write(b"\xff" * 4096):
                pass
        except OSError:
            pass
    return path
