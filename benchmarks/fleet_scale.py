"""Fleet scale: one coordinator and one Mosquitto with 1,000 / 5,000 / 10,000 registered devices.

    python benchmarks/fleet_scale.py [--quick] [--out runs/bench]

The coordinator runs as its own process (`python -m fedper.coordinator.cli`, --clients-per-round 100
--over-select 1.3), so its peak RSS (wait4's ru_maxrss) and CPU seconds (/proc/<pid>/stat, sampled when
each round opens) are its own. The devices are scripted: a minimal MQTT 3.1.1 client over asyncio
streams (CONNECT with a last will, SUBSCRIBE, PUBLISH QoS 0/1, PUBACK, PINGREQ; a paho client per
device would cost a thread and a socket pair each), a few hundred to thousands per worker process.

A scripted device registers (n_samples), publishes its presence `online` (last will `offline`),
subscribes to RoundInfo, its invitation and its error topic, and waits. Invited, it waits a random
"training" time, then either vanishes (30 %: its socket is aborted, the broker publishes its last will)
or sends a precomputed update for the invited round (fedper.payload + fedper.wire.chunk, QoS 1). It
skips the model download: every tensor of its update is filled with its own constant v_j, so the
model after round k is exactly sum(n_j v_j) / sum(n_j) over the devices that metrics.jsonl lists
as round k's participants; a monitor client collects every round's model blob from the broker and
the benchmark checks it against that mean (and that every participant did send).

With F = 1.3 and 30 % of the invited vanishing, about 91 of 130 invited answer, fewer than M = 100; each
device that vanishes (its will says offline) or has not answered within --answer-timeout (half of
--round-timeout) is replaced by the next in the ranking, so rounds close at M when the replacements
answer in time, else at their deadline (--min-clients 50); `last_accept_s` (from the coordinator's
state messages, 0.5 s apart) is when the round's last update was folded. Round 1 includes taking in
the whole fleet's registrations; `steady` figures are rounds 2 and later.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing as mp
import os
import random
import resource
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
from common import main, table, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.toy_export import write_toy_export  # the tests' export of a hand-made manifest

from fedper.manifest import Manifest, ModelInfo, TensorSpec
from fedper.payload import decode_shared, encode_shared
from fedper.ports import free_port
from fedper.wire import ErrorMessage, Invitation, Reassembler, Register, RoundInfo, Topics, UpdateMeta, chunk

FLEET = "scale"
CLIENTS_PER_ROUND = 100
OVER_SELECT = 1.3
VANISH = 0.3  # share of invited devices that disconnect without answering
MIN_CLIENTS = 50
KEEPALIVE_S = 120
CONNECTS_IN_FLIGHT = 64  # per worker process: connection attempts at a time


# ------------------------------------------------------------ a minimal MQTT 3.1.1 client


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, digit = divmod(n, 128)
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _string(s: str | bytes) -> bytes:
    data = s.encode() if isinstance(s, str) else s
    return struct.pack("!H", len(data)) + data


def _packet(kind: int, body: bytes) -> bytes:
    return bytes([kind]) + _varint(len(body)) + body


class MiniMqtt:
    """Just what a scripted device needs: one socket and one reader task, no thread."""

    def __init__(self, client_id: str, on_message: Any = None) -> None:
        self.client_id, self.on_message = client_id, on_message
        self._acks: dict[int, asyncio.Future[None]] = {}
        self._next_id = 0
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self.closed = asyncio.Event()

    async def connect(self, host: str, port: int, will: tuple[str, bytes] | None = None) -> None:
        self._reader, self._writer = await asyncio.open_connection(host, port)
        flags = 0x02  # clean session
        payload = _string(self.client_id)
        if will:
            flags |= 0x04 | 0x08 | 0x20  # will, QoS 1, retained
            payload += _string(will[0]) + _string(will[1])
        self._writer.write(_packet(0x10, _string("MQTT") + bytes([4, flags]) + struct.pack("!H", KEEPALIVE_S)
                                   + payload))
        kind, body = await self._read()
        if kind >> 4 != 2 or body[1] != 0:
            raise ConnectionError(f"{self.client_id}: CONNACK refused ({body!r})")
        self._task = asyncio.create_task(self._loop())

    async def _read(self) -> tuple[int, bytes]:
        assert self._reader is not None
        kind = (await self._reader.readexactly(1))[0]
        length, shift = 0, 0
        while True:
            digit = (await self._reader.readexactly(1))[0]
            length += (digit & 0x7F) << shift
            shift += 7
            if not digit & 0x80:
                break
        return kind, await self._reader.readexactly(length) if length else b""

    async def _loop(self) -> None:
        try:
            while True:
                kind, body = await self._read()
                if kind >> 4 == 3:  # PUBLISH
                    qos = (kind >> 1) & 3
                    (topic_len,) = struct.unpack_from("!H", body)
                    topic = body[2:2 + topic_len].decode()
                    start = 2 + topic_len
                    if qos:
                        self._write(_packet(0x40, body[start:start + 2]))  # PUBACK
                        start += 2
                    if self.on_message:
                        self.on_message(topic, body[start:])
                elif kind >> 4 in (4, 9):  # PUBACK, SUBACK
                    future = self._acks.pop(struct.unpack_from("!H", body)[0], None)
                    if future and not future.done():
                        future.set_result(None)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            self.closed.set()
            for future in self._acks.values():
                if not future.done():
                    future.set_exception(ConnectionError("connection lost"))

    def _write(self, data: bytes) -> None:
        if self._writer and not self._writer.is_closing():
            self._writer.write(data)

    def _packet_id(self) -> tuple[int, asyncio.Future[None]]:
        self._next_id = self._next_id % 65535 + 1
        future = asyncio.get_running_loop().create_future()
        if self.closed.is_set():  # the reader has ended: no acknowledgement can come
            future.set_exception(ConnectionError("connection lost"))
        else:
            self._acks[self._next_id] = future
        return self._next_id, future

    async def subscribe(self, topics: list[str]) -> None:
        pid, future = self._packet_id()
        self._write(_packet(0x82, struct.pack("!H", pid) + b"".join(_string(t) + b"\x01" for t in topics)))
        await future

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> asyncio.Future[None] | None:
        """Queue a PUBLISH; with QoS 1, the future of its PUBACK."""
        future = None
        body = _string(topic)
        if qos:
            pid, future = self._packet_id()
            body += struct.pack("!H", pid)
        self._write(_packet(0x30 | qos << 1 | int(retain), body + payload))
        return future

    def ping(self) -> None:
        self._write(b"\xc0\x00")

    def abort(self) -> None:
        """Vanish: the socket is dropped without DISCONNECT, so the broker publishes the last will."""
        if self._writer:
            self._writer.transport.abort()

    async def disconnect(self) -> None:
        self._write(b"\xe0\x00")
        if self._writer:
            self._writer.close()


# ------------------------------------------------------------ the model and the scripted devices


def manifest_of(floats: int) -> Manifest:
    """A hand-made manifest: four shared tensors of `floats` float32 values in all, and a local head."""
    quarter = floats // 4
    spec = [(f"base.l{i}.weight", (quarter // 64, 64), True) for i in range(4)] + [("head.weight", (10, 8), False)]
    tensors = tuple(TensorSpec(n, s, "float32", "base" if shared else "head", True, shared=shared)
                    for n, s, shared in spec)
    info = ModelInfo("scale", kp=1, num_classes=10, input_shape=(3, 1, 1), mean=(0.0,) * 3, std=(1.0,) * 3)
    return Manifest(model=info, algorithm="fedper", tensors=tensors)


def device_plan(index: int) -> tuple[int, np.float32]:
    """(n_samples, v_j) of scripted device `index`: every value of its update is v_j."""
    return 1 + index % 50, np.float32((index % 1000) / 1000)


def filled(manifest: Manifest, value: float) -> dict[str, np.ndarray]:
    return {t.name: np.full(t.shape, value, dtype=np.float32) for t in manifest.shared_tensors}


@dataclass
class WorkerReport:
    sent: dict[int, list[str]] = field(default_factory=dict)  # round -> devices whose update was acknowledged
    vanished: dict[int, list[str]] = field(default_factory=dict)  # round -> devices that vanished when invited
    errors: Counter[str] = field(default_factory=Counter)
    published: int = 0  # messages the devices published (the wills of the vanished come on top)


async def _devices(host: str, port: int, indices: list[int], floats: int, train_s: float, chunk_size: int,
                   ready: Any, stop: Any) -> WorkerReport:
    manifest, topics, report = manifest_of(floats), Topics(FLEET), WorkerReport()
    clients: list[MiniMqtt] = []
    gate = asyncio.Semaphore(CONNECTS_IN_FLIGHT)
    busy: set[asyncio.Task[None]] = set()

    async def answer(client: MiniMqtt, index: int, round_: int, training: asyncio.Lock) -> None:
        """Train and upload, one round at a time per device: a late answer to an earlier round that vanishes
        must not drop the socket under this round's upload once the broker has taken it."""
        name = client.client_id
        async with training:
            await asyncio.sleep(random.uniform(0, train_s))
            if random.Random(f"{name}/{round_}").random() < VANISH:
                report.vanished.setdefault(round_, []).append(name)
                client.abort()
                return
            n, value = device_plan(index)
            blob = encode_shared(manifest, filled(manifest, float(value)))
            meta = UpdateMeta(round_, n, manifest.base_digest, {"accuracy": float(value)}).to_dict()
            frames = chunk(blob, chunk_size, f"r{round_}-{name}", meta)
            acks = [client.publish(topics.update(name), frame) for frame in frames]
            try:
                await asyncio.gather(*acks)
            except ConnectionError:  # it vanished in an earlier round's answer: nothing was written
                return
            report.published += len(frames)
            report.sent.setdefault(round_, []).append(name)

    def device(index: int) -> MiniMqtt:
        state: dict[str, Any] = {"open": 0, "invited": 0, "answered": 0}
        client, training = MiniMqtt(f"dev-{index:05d}"), asyncio.Lock()

        def on_message(topic: str, payload: bytes) -> None:
            if not payload:
                return
            if topic == topics.round:
                info = RoundInfo.decode(payload)
                state["open"] = info.round if info.state == "open" else 0
            elif "/invite/" in topic:
                state["invited"] = Invitation.decode(payload).round
            else:
                report.errors[ErrorMessage.decode(payload).code] += 1
                return
            if state["invited"] == state["open"] > state["answered"]:  # the invitation of the open round
                state["answered"] = state["open"]
                task = asyncio.create_task(answer(client, index, state["open"], training))
                busy.add(task)
                task.add_done_callback(busy.discard)

        client.on_message = on_message
        return client

    async def join(index: int) -> None:
        client = device(index)
        name = client.client_id
        async with gate:
            for attempt in range(5):
                try:
                    await client.connect(host, port, will=(topics.presence(name), b"offline"))
                    break
                except OSError:
                    await asyncio.sleep(0.2 * (attempt + 1))
            else:
                raise ConnectionError(f"{name} could not connect")
            await client.subscribe([topics.round, topics.invite(name), topics.error(name)])
        n, _ = device_plan(index)
        client.publish(topics.register(name), Register(n, manifest.base_digest, "scripted/1").encode(), retain=True)
        client.publish(topics.presence(name), b"online", retain=True)
        report.published += 2
        clients.append(client)

    await asyncio.gather(*(join(i) for i in indices))
    ready.put(len(clients))
    last_ping = time.monotonic()
    while not stop.is_set():
        await asyncio.sleep(0.2)
        if time.monotonic() - last_ping > KEEPALIVE_S / 2:
            last_ping = time.monotonic()
            for client in clients:
                client.ping()
    if busy:  # an upload the coordinator already folded may still wait for its PUBACK: let it be counted
        await asyncio.wait(busy, timeout=10)
    for client in clients:
        if not client.closed.is_set():
            await client.disconnect()
    return report


def _worker(host: str, port: int, indices: list[int], floats: int, train_s: float, chunk_size: int,
            ready: Any, stop: Any, results: Any) -> None:
    """One worker process: its devices in one asyncio loop; puts its WorkerReport (as a dict) on `results`."""
    _raise_fd_limit()
    report = asyncio.run(_devices(host, port, indices, floats, train_s, chunk_size, ready, stop))
    results.put({"sent": report.sent, "vanished": report.vanished, "errors": dict(report.errors),
                 "published": report.published})


def _raise_fd_limit() -> int:
    """Every device is a socket at each end: raise the soft open-files limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


# ------------------------------------------------------------ the broker, the coordinator, the monitor


def start_mosquitto(directory: Path, port: int) -> subprocess.Popen[bytes]:
    """Mosquitto on loopback (as tests/conftest.py's Broker), with no connection or queue limits: the
    coordinator's queue takes the whole fleet's registrations at once."""
    user = "user root\n" if os.geteuid() == 0 else ""
    conf = directory / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n{user}"
                    "max_connections -1\nmax_queued_messages 0\nmax_queued_bytes 0\nmax_inflight_messages 0\n"
                    "sys_interval 1\nlog_type error\nlog_type warning\n"
                    f"log_dest file {directory / 'mosquitto.log'}\n")
    return start_broker(conf, port)


def reap(coordinator: subprocess.Popen[bytes], log: IO[bytes], directory: Path) -> Any:
    """Wait for the coordinator (killed if the monitor gave up on it) and return its resource usage (wait4:
    its peak RSS); RuntimeError with its log's end if it failed."""
    if not exited(coordinator.pid):
        coordinator.kill()  # past the monitor's timeout: the exit status says so
    _, status, usage = os.wait4(coordinator.pid, 0)
    coordinator.returncode = os.waitstatus_to_exitcode(status)
    log.close()
    if coordinator.returncode != 0:
        raise RuntimeError(f"coordinator exited {coordinator.returncode}: "
                           f"{(directory / 'coordinator.log').read_text()[-2000:]}")
    return usage


def start_broker(conf: Path, port: int) -> subprocess.Popen[bytes]:
    """Mosquitto with the configuration file `conf`, once it listens on loopback `port`."""
    proc = subprocess.Popen([shutil.which("mosquitto") or "/usr/sbin/mosquitto", "-c", str(conf)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"mosquitto did not listen on {port}")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a live process, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def exited(pid: int) -> bool:
    """Whether a child exited, leaving it unreaped (WNOWAIT): its rusage is then read by wait4 alone."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def rss_mib(pid: int, field: str = "VmHWM") -> float:
    """VmHWM (the peak resident set) or VmRSS (now) of a live process, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Observed:
    """What the monitor client saw: each round's opening time and the coordinator's CPU then, the state
    messages' accepted counts, each round's model blob, and the broker's $SYS figures."""

    opened: dict[int, tuple[float, float, float]] = field(default_factory=dict)  # round -> (wall, cpu s, RSS MiB)
    accepted_at: dict[int, tuple[int, float]] = field(default_factory=dict)  # round -> (accepted, first seen at)
    models: dict[str, bytes] = field(default_factory=dict)  # blob id -> blob
    registered_at: float | None = None
    broker: dict[str, str] = field(default_factory=dict)


async def _monitor(port: int, coordinator: subprocess.Popen[bytes], fleet_size: int, timeout: float) -> Observed:
    """Follow the run until the coordinator exits (or `timeout`)."""
    topics, seen = Topics(FLEET), Observed()
    reassembler = Reassembler(1 << 26)

    def on_message(topic: str, payload: bytes) -> None:
        if not payload:
            return
        now = time.time()
        if topic == topics.round:
            info = RoundInfo.decode(payload)
            if info.state == "open" and info.round not in seen.opened:
                seen.opened[info.round] = (now, cpu_seconds(coordinator.pid),  # a zombie's stat still reads
                                           rss_mib(coordinator.pid, "VmRSS"))
        elif topic == topics.state:
            state = json.loads(payload)
            if state.get("status") == "online":
                accepted = state["accepted_this_round"]
                if accepted > seen.accepted_at.get(state["round"], (0, 0.0))[0]:
                    seen.accepted_at[state["round"]] = (accepted, now)
                if seen.registered_at is None and state["registered"] >= fleet_size:
                    seen.registered_at = now
        elif topic.startswith("$SYS/"):
            seen.broker[topic.removeprefix("$SYS/broker/")] = payload.decode()
        else:
            blob = reassembler.add("coordinator", payload)
            if blob is not None:
                seen.models[blob.blob_id] = blob.data

    client = MiniMqtt("scale-monitor", on_message)
    await client.connect("127.0.0.1", port)
    await client.subscribe([topics.round, topics.state, f"{topics.base}/model/#", "$SYS/broker/#"])
    deadline = time.monotonic() + timeout
    while not exited(coordinator.pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.2)  # the final model's chunks and one more $SYS report
    await client.disconnect()
    return seen


def run_fleet(size: int, rounds: int, *, floats: int, workers: int, round_timeout: float, train_s: float,
              directory: Path, chunk_size: int = 63 * 1024, timeout: float = 600.0) -> dict[str, Any]:
    """One fleet of `size` scripted devices for `rounds` rounds; the figures and the aggregate's check."""
    _raise_fd_limit()
    manifest = manifest_of(floats)
    artifacts, state_dir = directory / "export", directory / "state"
    write_toy_export(artifacts, manifest, filled(manifest, 0.0))  # the coordinator verifies its export at start
    port = free_port()
    broker = start_mosquitto(directory, port)
    context = mp.get_context("fork")
    ready, results, stop = context.Queue(), context.Queue(), context.Event()
    shares = [list(range(size))[w::workers] for w in range(workers)]
    procs = [context.Process(target=_worker, args=("127.0.0.1", port, share, floats, train_s, chunk_size, ready,
                                                   stop, results), daemon=True) for share in shares]
    coordinator = None
    try:
        started = time.perf_counter()
        for p in procs:
            p.start()
        for _ in procs:  # every worker has connected and registered its devices
            ready.get(timeout=timeout)
        connect_s = time.perf_counter() - started
        log = open(directory / "coordinator.log", "wb")  # noqa: SIM115 (closed with the process)
        coordinator = subprocess.Popen(
            [sys.executable, "-m", "fedper.coordinator.cli", "--artifacts", str(artifacts), "--fleet", FLEET,
             "--broker", f"mqtt://127.0.0.1:{port}", "--rounds", str(rounds), "--min-clients", str(MIN_CLIENTS),
             "--round-timeout", str(round_timeout), "--clients-per-round", str(CLIENTS_PER_ROUND),
             "--over-select", str(OVER_SELECT), "--chunk-size", str(chunk_size), "--state-dir", str(state_dir)],
            stdout=log, stderr=subprocess.STDOUT)
        launched = time.time()
        seen = asyncio.run(_monitor(port, coordinator, size, timeout))
        usage = reap(coordinator, log, directory)
        broker_rss = rss_mib(broker.pid)
        stop.set()
        reports = [results.get(timeout=60) for _ in procs]
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        if coordinator and coordinator.poll() is None:
            coordinator.kill()
        broker.terminate()
        broker.wait(10)
    cpu_total = usage.ru_utime + usage.ru_stime
    records = [json.loads(line) for line in (state_dir / "metrics.jsonl").read_text().splitlines()]
    check = verify(manifest, records, seen, reports)
    opened = [seen.opened[k] for k in sorted(seen.opened)]
    per_round = []
    for i, r in enumerate(records):
        k = r["round"]
        end_cpu = opened[i + 1][1] if i + 1 < len(opened) else cpu_total
        _, at = seen.accepted_at.get(k, (0, math.nan))
        per_round.append({"round": k, "invited": r.get("invited"), "participants": r["participants"],
                          "rss_at_open_mib": round(opened[i][2], 1),
                          "cpu_s": round(end_cpu - opened[i][1], 3), "collect_s": r["collect_s"],
                          "last_accept_s": round(at - opened[i][0], 2), "aggregate_s": r["aggregate_s"]})
    steady = per_round[1:] or per_round
    published = sum(rep["published"] for rep in reports)
    vanished = sum(len(v) for rep in reports for v in rep["vanished"].values())
    return {
        "devices": size, "rounds": rounds, "model_floats": floats, "workers": workers,
        "connect_s": round(connect_s, 2),
        "registrations_s": round((seen.registered_at or math.nan) - launched, 2),
        "coordinator_peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
        "coordinator_cpu_s": round(cpu_total, 2),
        "coordinator_rss_steady_mib": max(r["rss_at_open_mib"] for r in steady),
        "cpu_s_per_round_steady": round(float(np.mean([r["cpu_s"] for r in steady])), 3),
        "cpu_ms_per_accepted_update_steady": round(1000 * sum(r["cpu_s"] for r in steady)
                                                   / sum(r["participants"] for r in steady), 2),
        "round_wall_s_steady": round(float(np.mean([r["collect_s"] for r in steady])), 2),
        "last_accept_s_steady": round(float(np.mean([r["last_accept_s"] for r in steady])), 2),
        "messages_to_coordinator": published + vanished,  # register, presence, update chunks, and the wills
        "broker_peak_rss_mib": round(broker_rss, 1),
        "broker_messages_received": int(seen.broker.get("messages/received", 0)),
        "broker_messages_sent": int(seen.broker.get("messages/sent", 0)),
        "device_errors": dict(sum((Counter(rep["errors"]) for rep in reports), Counter())),
        "per_round": per_round, **check,
    }


def verify(manifest: Manifest, records: list[dict[str, Any]], seen: Observed,
           reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Every round's model is the n_j-weighted mean of exactly the updates metrics.jsonl lists, each of
    which a device sent (and the broker acknowledged) for that round."""
    sent: dict[int, set[str]] = {}
    for rep in reports:
        for k, devices in rep["sent"].items():
            sent.setdefault(int(k), set()).update(devices)
    accepted = 0
    for r in records:
        k, devices = r["round"], r["devices"]
        assert set(devices) <= sent.get(k, set()), f"round {k}: participants that sent nothing"
        plans = [device_plan(int(d.removeprefix("dev-"))) for d in devices]
        assert sum(n for n, _ in plans) == r["n_samples"], f"round {k}: n_samples"
        expected = np.float32(sum(n * np.float64(v) for n, v in plans) / sum(n for n, _ in plans))
        blob_id = "final" if r is records[-1] else f"r{k + 1}"
        model = decode_shared(manifest, seen.models[blob_id])
        for name, tensor in model.items():
            assert np.array_equal(tensor, np.full(tensor.shape, expected, np.float32)), f"round {k}: {name}"
        accepted += len(devices)
    return {"accepted_updates": accepted, "sent_updates": sum(len(v) for v in sent.values()),
            "aggregates_verified": len(records)}


def run(out: Path, quick: bool) -> str:
    sizes, rounds = ((400,), 3) if quick else ((1_000, 5_000, 10_000), 5)
    floats = 16_384 if quick else 100_000
    results = []
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix=f"fleet{size}-") as tmp:
            results.append(run_fleet(size, rounds, floats=floats, workers=2 if quick else 4,
                                     round_timeout=4.0 if quick else 8.0, train_s=1.0 if quick else 2.0,
                                     directory=Path(tmp)))
        print(f"  {size} devices done", file=sys.stderr, flush=True)
    write_json(out, "fleet_scale", {"clients_per_round": CLIENTS_PER_ROUND, "over_select": OVER_SELECT,
                                    "vanish": VANISH, "results": results})
    header = ["devices", "coord. peak RSS MiB", "coord. RSS rounds 2+ MiB", "coord. CPU s/round", "CPU ms/update",
              "round wall s", "last accept s", "msgs to coord.", "broker msgs in/out", "broker peak RSS MiB",
              "accepted = aggregated", "connect s"]
    rows = [[r["devices"], r["coordinator_peak_rss_mib"], r["coordinator_rss_steady_mib"], r["cpu_s_per_round_steady"],
             r["cpu_ms_per_accepted_update_steady"], r["round_wall_s_steady"], r["last_accept_s_steady"],
             r["messages_to_coordinator"], f"{r['broker_messages_received']}/{r['broker_messages_sent']}",
             r["broker_peak_rss_mib"], f"{r['accepted_updates']} in {r['aggregates_verified']} rounds",
             r["connect_s"]] for r in results]
    return table(header, rows)


if __name__ == "__main__":
    main(run, __doc__, quick="400 devices, 3 rounds, a 16 K-float model")
