"""Asynchronous rounds (--mode async, FedBuff) against synchronous rounds with over-selection, through a real
Mosquitto; and the coordinator's cost per folded update as the connected fleet grows.

    python benchmarks/async_fleet.py [--quick] [--out runs/bench] [--part pace|scale|all] [--sizes 10000,100000]
                                     [--versions 40]

Part `pace`: 40 scripted devices that learn (softmax regression on sklearn's digits, each device holding two
classes, five local epochs of SGD on the model it downloaded) and take their time: 20 fast (0.5-1 s a
training), 12 slow (4-6 s) and 8 that vanish (1-2 s; on 40 % of their invitations they drop their socket
halfway, the broker publishes their last will, and they come back 5 s later). The coordinator is the real one
(`fedper-coordinator`, its own process). Synchronous: --clients-per-round 10 --over-select 1.3
--min-clients 5 --round-timeout 6. Asynchronous: --mode async --clients-per-round 13 (the same 13 devices
at work) --buffer-size 5 --max-staleness 10. Each runs the same wall time; a monitor client evaluates every
released model on the digits test split as it arrives. Figures: versions per minute, updates folded per
minute, time (and uploads) to a target accuracy, the final accuracy; the load average with each.

Part `scale`: N scripted devices connected and registered (benchmarks/fleet_scale.py's minimal MQTT
client, idle but for keep-alive pings), of which --clients-per-round 100 train at once (a random 0-2 s each,
then a precomputed update of a 100,000-float model, tagged with the round it was invited to), a version every
--buffer-size 10 updates. Figure: the coordinator's CPU seconds per folded update over the versions after the
second and after every device registered (its whole process: /proc/<pid>/stat, sampled as each version
opens), at each N; and net of the coordinator's cost per second of wall time, measured first with no
device (its loop and keep-alive: a run whose devices deliver few updates a second divides it among few).
One Mosquitto holds at most about 20,000 connections here (the container's hard limit of open files per
process), so a fleet above that is spread over edge brokers bridged to the one the coordinator uses
(Mosquitto bridges, topics split by direction), as a large deployment would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fleet_scale
import numpy as np
from common import table, write_json
from helpers.toy_export import write_toy_export  # fleet_scale put tests/ on the path: the tests' toy export

from fedper.manifest import Manifest, ModelInfo, TensorSpec
from fedper.payload import decode_shared, encode_shared
from fedper.ports import free_port
from fedper.wire import ErrorMessage, Invitation, Reassembler, Register, RoundInfo, Topics, UpdateMeta, chunk

FLEET = "pace"
TOPICS = Topics(FLEET)
TARGET = 0.85  # test accuracy of the released model
KINDS = {"fast": (20, (0.5, 1.0)), "slow": (12, (4.0, 6.0)), "vanishing": (8, (1.0, 2.0))}
VANISH_P, AWAY_S = 0.4, 5.0
SYNC = ("--clients-per-round", "10", "--over-select", "1.3", "--min-clients", "5", "--round-timeout", "6")
ASYNC = ("--mode", "async", "--clients-per-round", "13", "--buffer-size", "5", "--max-staleness", "10",
         "--round-timeout", "30")


# ------------------------------------------------------------ a model that learns: softmax regression on digits


def learner_manifest() -> Manifest:
    spec = [("w", (64, 10), "base", True), ("b", (10,), "base", True), ("head.bias", (10,), "head", False)]
    info = ModelInfo("digits-softmax", kp=1, num_classes=10, input_shape=(1, 8, 8), mean=(0.0,), std=(1.0,))
    return Manifest(model=info, algorithm="fedper",
                    tensors=tuple(TensorSpec(n, s, "float32", r, True, shared=shared) for n, s, r, shared in spec))


def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x, y = (data.data / 16.0).astype(np.float32), data.target
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order], y[order]
    return x[:1400], y[:1400], x[1400:], y[1400:]


def train(model: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, rng: np.random.Generator,
          epochs: int = 5, lr: float = 0.5, batch: int = 16) -> dict[str, np.ndarray]:
    w, b = model["w"].astype(np.float64), model["b"].astype(np.float64)
    for _ in range(epochs):
        order = rng.permutation(len(y))
        for start in range(0, len(y), batch):
            idx = order[start:start + batch]
            logits = x[idx] @ w + b
            p = np.exp(logits - logits.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            p[np.arange(len(idx)), y[idx]] -= 1
            w -= lr * x[idx].T @ p / len(idx)
            b -= lr * p.mean(0)
    return {"w": w.astype(np.float32), "b": b.astype(np.float32)}


def accuracy(model: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    return float(((x @ model["w"] + model["b"]).argmax(1) == y).mean())


# ------------------------------------------------------------ the scripted learners


@dataclass
class Learner:
    name: str
    kind: str
    x: np.ndarray
    y: np.ndarray
    rng: np.random.Generator
    port: int
    manifest: Manifest
    report: dict[str, Any]
    info: RoundInfo | None = None
    invited: int = 0
    trained: set[int] = field(default_factory=set)
    busy: bool = False
    client: fleet_scale.MiniMqtt | None = None
    blobs: dict[str, bytes] = field(default_factory=dict)

    async def join(self) -> None:
        self.client = fleet_scale.MiniMqtt(self.name, self.on_message)
        await self.client.connect("127.0.0.1", self.port, will=(TOPICS.presence(self.name), b"offline"))
        await self.client.subscribe([TOPICS.round, TOPICS.invite(self.name), TOPICS.error(self.name),
                                     f"{TOPICS.base}/model/#"])
        self.reassembler = Reassembler(1 << 20)
        self.client.publish(TOPICS.register(self.name),
                            Register(len(self.y), self.manifest.base_digest, "pace/1").encode(), retain=True)
        self.client.publish(TOPICS.presence(self.name), b"online", retain=True)

    def on_message(self, topic: str, payload: bytes) -> None:
        if not payload:
            return
        if topic == TOPICS.round:
            self.info = RoundInfo.decode(payload)
        elif topic == TOPICS.invite(self.name):
            self.invited = Invitation.decode(payload).round
        elif topic == TOPICS.error(self.name):
            code = ErrorMessage.decode(payload).code
            self.report["errors"][code] = self.report["errors"].get(code, 0) + 1
            return
        else:
            blob = self.reassembler.add("coordinator", payload)
            if blob is not None:
                self.blobs = {blob.blob_id: blob.data}  # the newest only
        self.maybe_work()

    def maybe_work(self) -> None:
        """Train on the open round if invited to it, holding its model, not trained on it, and idle."""
        info = self.info
        if (self.busy or info is None or info.state != "open" or self.invited != info.round
                or info.round in self.trained or info.blob_id not in self.blobs):
            return
        self.busy = True
        self.trained.add(info.round)
        model = decode_shared(self.manifest, self.blobs[info.blob_id])
        asyncio.get_running_loop().create_task(self.work(info.round, model))

    async def work(self, round_: int, model: dict[str, np.ndarray]) -> None:
        low, high = KINDS[self.kind][1]
        seconds = float(self.rng.uniform(low, high))
        if self.kind == "vanishing" and self.rng.random() < VANISH_P:
            await asyncio.sleep(seconds / 2)
            assert self.client is not None
            self.client.abort()
            self.report["vanished"] += 1
            await asyncio.sleep(AWAY_S)
            self.busy = False
            await self.join()
            return
        await asyncio.sleep(seconds)
        trained = {**model, **train(model, self.x, self.y, self.rng)}
        meta = UpdateMeta(round_, len(self.y), self.manifest.base_digest)
        assert self.client is not None
        for frame in chunk(encode_shared(self.manifest, trained), 16_384, f"r{round_}-{self.name}", meta.to_dict()):
            self.client.publish(TOPICS.update(self.name), frame)
        self.report["sent"] += 1
        self.busy = False
        self.maybe_work()  # the open round may ask again


async def learners(port: int, stop_at: float, report: dict[str, Any]) -> None:
    manifest = learner_manifest()
    x, y, _, _ = digits()
    fleet, index = [], 0
    for kind, (count, _) in KINDS.items():
        for _ in range(count):
            classes = (index % 10, (index + 1) % 10)
            idx = np.flatnonzero(np.isin(y, classes))
            idx = np.random.default_rng(index).choice(idx, 60, replace=False)
            fleet.append(Learner(f"{kind}-{index:02d}", kind, x[idx], y[idx], np.random.default_rng(100 + index), port,
                                 manifest, report))
            index += 1
    await asyncio.gather(*(learner.join() for learner in fleet))
    while time.time() < stop_at:
        await asyncio.sleep(0.2)


def _learners_process(port: int, stop_at: float, results: Any) -> None:
    report: dict[str, Any] = {"sent": 0, "vanished": 0, "errors": {}}
    asyncio.run(learners(port, stop_at, report))
    results.put(report)


async def monitor(port: int, started: float, stop_at: float) -> list[tuple[float, int, float]]:
    """(seconds since start, version, test accuracy) of every released model, as it arrives."""
    manifest, (_, _, x_test, y_test) = learner_manifest(), digits()
    reassembler, seen, curve = Reassembler(1 << 20), set(), []

    def on_message(topic: str, payload: bytes) -> None:
        if not payload or topic == TOPICS.round:
            return
        blob = reassembler.add("coordinator", payload)
        if blob is not None and blob.blob_id not in seen:
            seen.add(blob.blob_id)
            version = int(blob.blob_id.removeprefix("r")) if blob.blob_id != "final" else -1
            curve.append((time.time() - started, version, accuracy(decode_shared(manifest, blob.data), x_test,
                                                                   y_test)))

    client = fleet_scale.MiniMqtt("pace-monitor", on_message)
    await client.connect("127.0.0.1", port)
    await client.subscribe([f"{TOPICS.base}/model/#"])
    while time.time() < stop_at:
        await asyncio.sleep(0.1)
    await client.disconnect()
    return curve


def run_pace(mode: str, seconds: float, directory: Path) -> dict[str, Any]:
    """One mode for `seconds` of wall time: its curve and figures."""
    manifest = learner_manifest()
    artifacts, state = directory / "export", directory / "state"
    initial = {"w": np.zeros((64, 10), np.float32), "b": np.zeros(10, np.float32)}
    write_toy_export(artifacts, manifest, initial)  # the coordinator verifies its export at start
    port = free_port()
    broker = fleet_scale.start_mosquitto(directory, port)
    load_before = os.getloadavg()[0]
    context = mp.get_context("fork")
    results = context.Queue()
    started = time.time()
    stop_at = started + seconds
    devices = context.Process(target=_learners_process, args=(port, stop_at, results), daemon=True)
    devices.start()
    time.sleep(2.0)  # every device connected and registered before the first round opens
    log = open(directory / "coordinator.log", "wb")  # noqa: SIM115 (closed with the process)
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "fedper.coordinator.cli", "--artifacts", str(artifacts), "--fleet", FLEET, "--broker",
         f"mqtt://127.0.0.1:{port}", "--state-dir", str(state), "--rounds", "100000", "--chunk-size", "16384",
         *(ASYNC if mode == "async" else SYNC)], stdout=log, stderr=subprocess.STDOUT)
    opened = time.time()
    try:
        curve = asyncio.run(monitor(port, opened, stop_at))
        cpu = fleet_scale.cpu_seconds(coordinator.pid)
        report = results.get(timeout=60)
    finally:
        coordinator.send_signal(signal.SIGKILL)
        coordinator.wait()
        log.close()
        devices.join(10)
        broker.terminate()
        broker.wait(10)
    load_after = os.getloadavg()[0]
    records = [json.loads(line) for line in (state / "metrics.jsonl").read_text().splitlines()]
    counters = json.loads((state / "state.json").read_text())["counters"]
    wall = stop_at - opened
    folded = sum(r["participants"] for r in records)
    reached = next(((t, v) for t, v, acc in curve if acc >= TARGET and v > 0), None)
    uploads_to_target = (sum(r["participants"] for r in records if r["round"] < reached[1]) if reached else None)
    staleness = [s for r in records for s in r.get("buffer", {}).get("staleness", [])]
    return {"mode": mode, "wall_s": round(wall, 1), "versions": len(records),
            "versions_per_min": round(60 * len(records) / wall, 1), "folded": folded,
            "folded_per_min": round(60 * folded / wall, 1), "sent": report["sent"], "vanished": report["vanished"],
            "refused": {k: v for k, v in counters.items() if k != "accepted"},
            "time_to_target_s": round(reached[0], 1) if reached else None,
            "uploads_to_target": uploads_to_target,
            "final_accuracy": round(curve[-1][2], 3) if curve else None,
            "mean_staleness": round(float(np.mean(staleness)), 2) if staleness else 0.0,
            "coordinator_cpu_s": round(cpu, 2), "load_before": round(load_before, 2),
            "load_after": round(load_after, 2), "curve": [(round(t, 2), v, round(a, 4)) for t, v, a in curve]}


# ------------------------------------------------------------ scale: the cost per folded update


def bridge_conf(directory: Path, port: int, central: int, name: str) -> Path:
    """An edge Mosquitto bridged to the central one: devices' topics up, the coordinator's down."""
    user = "user root\n" if os.geteuid() == 0 else ""
    base = f"fedper/v1/{fleet_scale.FLEET}"
    conf = directory / f"{name}.conf"
    conf.write_text(
        f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n{user}"
        "max_connections -1\nmax_queued_messages 0\nmax_queued_bytes 0\nmax_inflight_messages 0\n"
        f"log_type error\nlog_dest file {directory / name}.log\n"
        f"connection {name}\naddress 127.0.0.1:{central}\nbridge_protocol_version mqttv311\ncleansession true\n"
        + "".join(f"topic {base}/{kind}/# out 1\n" for kind in ("register", "presence", "update"))
        + "".join(f"topic {base}/{kind} in 1\n" for kind in ("round", "state"))
        + "".join(f"topic {base}/{kind}/# in 1\n" for kind in ("model", "invite", "error")))
    return conf


PER_BROKER = 18_000  # devices per Mosquitto: under the 20,000 open files a process may hold here
PER_WORKER = 18_000  # devices per client process, for the same reason


def coordinator_command(artifacts: Path, fleet: str, port: int, state_dir: Path, versions: int, concurrency: int,
                        buffer_size: int) -> list[str]:
    return [sys.executable, "-m", "fedper.coordinator.cli", "--artifacts", str(artifacts), "--fleet", fleet,
            "--broker", f"mqtt://127.0.0.1:{port}", "--rounds", str(versions), "--mode", "async",
            "--clients-per-round", str(concurrency), "--buffer-size", str(buffer_size), "--max-staleness", "20",
            "--round-timeout", "120", "--chunk-size", str(63 * 1024), "--state-dir", str(state_dir)]


def idle_cpu_ms_per_s(command: list[str], settle_s: float = 5.0, seconds: float = 20.0) -> float:
    """The coordinator's CPU per second of wall time with no device at all (its 0.1 s loop, the MQTT client's
    keep-alive, state messages): a cost per second, not per update, which a run that folds few updates a second
    divides among few."""
    coordinator = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(settle_s)
        cpu, started = fleet_scale.cpu_seconds(coordinator.pid), time.perf_counter()
        time.sleep(seconds)
        return 1000 * (fleet_scale.cpu_seconds(coordinator.pid) - cpu) / (time.perf_counter() - started)
    finally:
        coordinator.terminate()
        coordinator.wait(10)


def run_scale(size: int, versions: int, directory: Path, floats: int = 100_000, concurrency: int = 100,
              buffer_size: int = 10, train_s: float = 2.0, timeout: float = 1800.0) -> dict[str, Any]:
    fleet_scale.VANISH = 0.0  # every invited device answers: the cost measured is the updates'
    fleet_scale._raise_fd_limit()
    manifest = fleet_scale.manifest_of(floats)
    artifacts, state_dir = directory / "export", directory / "state"
    write_toy_export(artifacts, manifest, fleet_scale.filled(manifest, 0.0))
    central = free_port()
    brokers = [fleet_scale.start_mosquitto(directory, central)]
    edges = [central]
    if size > PER_BROKER:
        for e in range(math.ceil(size / PER_BROKER)):
            port = free_port()
            brokers.append(fleet_scale.start_broker(bridge_conf(directory, port, central, f"edge{e}"), port))
            edges.append(port)
        edges = edges[1:]
    load_before = os.getloadavg()[0]
    idle = idle_cpu_ms_per_s(coordinator_command(artifacts, "idle", central, directory / "idle-state", versions,
                                                 concurrency, buffer_size))  # a fleet nobody is in
    context = mp.get_context("fork")
    ready, results, stop = context.Queue(), context.Queue(), context.Event()
    workers = max(2, math.ceil(size / PER_WORKER), len(edges))  # each worker's devices on one broker
    shares = [list(range(size))[w::workers] for w in range(workers)]
    procs = [context.Process(target=fleet_scale._worker, args=("127.0.0.1", edges[w % len(edges)], share, floats,
                                                               train_s, 63 * 1024, ready, stop, results),
                             daemon=True) for w, share in enumerate(shares)]
    coordinator = None
    try:
        started = time.perf_counter()
        for p in procs:
            p.start()
        for _ in procs:
            ready.get(timeout=timeout)
        connect_s = time.perf_counter() - started
        log = open(directory / "coordinator.log", "wb")  # noqa: SIM115 (closed with the process)
        coordinator = subprocess.Popen(coordinator_command(artifacts, fleet_scale.FLEET, central, state_dir, versions,
                                                           concurrency, buffer_size), stdout=log,
                                       stderr=subprocess.STDOUT)
        seen = asyncio.run(fleet_scale._monitor(central, coordinator, size, timeout))
        usage = fleet_scale.reap(coordinator, log, directory)
        broker_rss = [round(fleet_scale.rss_mib(b.pid), 1) for b in brokers]
        stop.set()
        reports = [results.get(timeout=120) for _ in procs]
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        if coordinator and coordinator.poll() is None:
            coordinator.kill()
        for b in brokers:
            b.terminate()
            b.wait(10)
    load_after = os.getloadavg()[0]
    records = [json.loads(line) for line in (state_dir / "metrics.jsonl").read_text().splitlines()]
    opened = sorted(seen.opened.items())
    # from the first version opened after every device registered (a storm of `size` registrations and
    # presences is not the updates' cost), and at least version 3 (the buffer in its stride), to the last
    settled = [v for v, (at, _, _) in opened if seen.registered_at is not None and at >= seen.registered_at]
    first, last = max(3, settled[0] if settled else 3), opened[-1][0]
    cpu = opened[-1][1][1] - seen.opened[first][1]
    wall = opened[-1][1][0] - seen.opened[first][0]
    folded = sum(r["participants"] for r in records if first <= r["round"] < last)
    return {"devices": size, "brokers": len(brokers), "workers": workers, "versions": len(records),
            "connect_s": round(connect_s, 1), "registrations_s": round((seen.registered_at or math.nan)
                                                                          - seen.opened[1][0], 1),
            "cpu_ms_per_folded_update": round(1000 * cpu / folded, 2), "folded_measured": folded,
            "idle_cpu_ms_per_s": round(idle, 2),
            "net_cpu_ms_per_folded_update": round((1000 * cpu - idle * wall) / folded, 2),
            "measured_versions": [first, last], "coordinator_cpu_share": round(cpu / wall, 3),
            "folded_per_s": round(folded / wall, 1), "aggregate_ms_per_version": round(1000 * float(np.median(
                [r["aggregate_s"] for r in records if r["round"] >= first])), 1),
            "coordinator_peak_rss_mib": round(usage.ru_maxrss / 1024, 1), "broker_rss_mib": broker_rss,
            "device_errors": {k: v for rep in reports for k, v in rep["errors"].items()},
            "load_before": round(load_before, 2), "load_after": round(load_after, 2)}


# ------------------------------------------------------------ the command


def run(out: Path, quick: bool, part: str = "all", sizes: tuple[int, ...] | None = None,
        versions: int | None = None) -> str:
    tables, payload = [], {}
    if part in ("pace", "all"):
        seconds = 60.0 if quick else 150.0
        pace = []
        for mode in ("sync", "async"):
            with tempfile.TemporaryDirectory(prefix=f"pace-{mode}-") as tmp:
                pace.append(run_pace(mode, seconds, Path(tmp)))
            print(f"  pace {mode} done", file=sys.stderr, flush=True)
        payload["pace"] = {"target_accuracy": TARGET, "kinds": KINDS, "vanish_p": VANISH_P, "sync": SYNC,
                           "async": ASYNC, "results": pace}
        tables.append(table(
            ["mode", "versions/min", "updates folded/min", f"time to {TARGET:.0%} s", f"uploads to {TARGET:.0%}",
             "final accuracy", "mean staleness", "vanished", "coord. CPU s", "load avg before/after"],
            [[r["mode"], r["versions_per_min"], r["folded_per_min"], r["time_to_target_s"], r["uploads_to_target"],
              r["final_accuracy"], r["mean_staleness"], r["vanished"], r["coordinator_cpu_s"],
              f"{r['load_before']}/{r['load_after']}"] for r in pace]))
    if part in ("scale", "all"):
        scale = []
        for size in sizes or ((400,) if quick else (1_000, 10_000)):
            with tempfile.TemporaryDirectory(prefix=f"async-scale{size}-") as tmp:
                scale.append(run_scale(size, versions or (12 if quick else 40), Path(tmp)))
            print(f"  scale {size} done", file=sys.stderr, flush=True)
        payload["scale"] = scale
        tables.append(table(
            ["devices", "brokers", "versions measured", "CPU ms / folded update", "idle CPU ms / s",
             "net CPU ms / folded update", "folded/s", "coord. CPU share", "aggregate ms / version",
             "coord. peak RSS MiB", "connect s", "registrations s", "load avg before/after"],
            [[r["devices"], r["brokers"], "{}-{}".format(*r["measured_versions"]), r["cpu_ms_per_folded_update"],
              r["idle_cpu_ms_per_s"], r["net_cpu_ms_per_folded_update"], r["folded_per_s"],
              r["coordinator_cpu_share"], r["aggregate_ms_per_version"],
              r["coordinator_peak_rss_mib"], r["connect_s"], r["registrations_s"],
              f"{r['load_before']}/{r['load_after']}"] for r in scale]))
    write_json(out, "async_fleet", payload)
    return "\n\n".join(tables)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench"), help="folder for the JSON results")
    parser.add_argument("--quick", action="store_true", help="60 s per mode; 400 devices, 12 versions")
    parser.add_argument("--part", choices=("pace", "scale", "all"), default="all")
    parser.add_argument("--sizes", type=lambda text: tuple(int(s) for s in text.split(",")), default=None,
                        help="fleet sizes of the scale part, e.g. 10000,100000")
    parser.add_argument("--versions", type=int, default=None,
                        help="versions a scale run releases (default 40, 12 with --quick); those opened before every "
                             "device registered are not measured")
    args = parser.parse_args()
    print(run(args.out, args.quick, args.part, args.sizes, args.versions))
