"""One device with valid credentials floods its own update topic: per-device quotas keep it its own problem.

Issue 16, item 4: a device flooding its (ACL-permitted) update topic with half-finished blobs of
one-byte chunks used to push honest devices' partial uploads out of the coordinator's reassembly
cache. Here the per-device message rate limit (coordinator/quota.py) is checked on its own and in
the engine, and then a real coordinator process, three real agents and a real Mosquitto run rounds
while a raw MQTT client (a socket and hand-built packets: no paho, no fedper.wire encoder) floods.
Every frame is built by hand from docs/protocol.md (json, struct, zlib, hashlib).
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.processes import Processes, agent_args, coordinator_args, finish, write_device_data
from helpers.recording import Recorder
from vectors.make_vectors import tiny_manifest, tiny_tensors

from fedper.coordinator.config import Config
from fedper.coordinator.durable import Coordinator
from fedper.coordinator.quota import REPORT_EVERY_S, MessageRateLimit
from fedper.coordinator.store import Store
from fedper.manifest import Manifest
from fedper.wire import Topics

DEPLOY_CONF = Path(__file__).resolve().parents[1] / "deploy" / "mosquitto" / "fedper.conf"


def frame(blob_id: str, index: int, size: int, chunk_size: int, blob: bytes, meta: dict) -> bytes:
    """Chunk `index` of a blob, framed by hand: u32 header length, u32 crc32, JSON header, data."""
    count = max(1, -(-size // chunk_size))
    header = json.dumps({"v": 1, "blob_id": blob_id, "index": index, "count": count, "size": size,
                         "chunk_size": chunk_size, "sha256": hashlib.sha256(blob).hexdigest(), "meta": meta},
                        separators=(",", ":")).encode()
    data = blob[index * chunk_size : (index + 1) * chunk_size]
    return struct.pack(">II", len(header), zlib.crc32(header + data)) + header + data


def register(n_samples: int, digest: str) -> bytes:
    return json.dumps({"v": 1, "n_samples": n_samples, "base_digest": digest, "software": "attacker/1"}).encode()


# ---------------------------------------------------------------- the rate limit on its own


def test_rate_limit_admits_bursts_refills_and_reports_once_per_window() -> None:
    limit = MessageRateLimit(rate=10, burst=20)
    assert all(limit.admit("dev", 0.0) for _ in range(20))
    assert not limit.admit("dev", 0.0)
    assert limit.admit("other", 0.0)  # another device's bucket is its own
    assert limit.report_due("dev", 0.0) == 1
    for _ in range(50):
        assert not limit.admit("dev", 0.05)
    assert limit.report_due("dev", 0.05) == 0  # one report per window, however many drops
    assert limit.admit("dev", 0.15) and not limit.admit("dev", 0.15)  # 0.15 s at 10/s: 1.5 tokens
    assert limit.report_due("dev", REPORT_EVERY_S + 0.01) == 51


def test_rate_limit_counts_every_drop_of_concurrent_threads_once() -> None:
    """The service admits in paho's network thread while the engine takes the drop counts in its own:
    every message is either admitted or handed out as dropped exactly once."""
    limit = MessageRateLimit(rate=1, burst=1000)
    taken: list[dict[str, int]] = []
    flooding = [threading.Thread(target=lambda d=d: [limit.admit(d, 0.0) for _ in range(20_000)]) for d in "ab"]
    for thread in flooding:
        thread.start()
    while any(thread.is_alive() for thread in flooding):
        taken.append(limit.take_dropped())
    taken.append(limit.take_dropped())
    assert {d: sum(t.get(d, 0) for t in taken) for d in "ab"} == {"a": 19_000, "b": 19_000}
    assert limit.take_dropped() == {}


def test_rate_limit_forgets_only_refilled_buckets() -> None:
    limit = MessageRateLimit(rate=1, burst=2, max_devices=3)
    for device in ("a", "b", "c"):
        limit.admit(device, 0.0)
        limit.admit(device, 0.0)
    limit.admit("c", 5.0)  # c refills and spends one; a and b refilled by now and are forgotten
    assert limit.admit("d", 5.0)
    assert sorted(limit._buckets) == ["c", "d"]
    assert limit.admit("a", 5.0) and limit.admit("a", 5.0) and not limit.admit("a", 5.0)  # a fresh, full bucket


# ---------------------------------------------------------------- the engine


def test_engine_drops_a_flood_early_answers_once_per_window_and_folds_every_honest_update(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Three honest devices have half their update in the engine when a registered device sends
    50,000 one-byte chunks of 50,000 never-finished blobs within 20 s: the rest of the honest
    updates are all folded, the flood is dropped unread above the rate (counted per message,
    logged and answered once per window), what passed the rate displaced only the flooder's
    own partial blobs, and past --max-uploads-per-round (16) blobs the flooder is answered
    over_quota once and its uploads are dropped unread (counted)."""
    manifest, initial = tiny_manifest(), tiny_tensors()
    config = Config.of(rounds=1, min_clients=3, round_timeout=60, max_messages_per_second=500)
    coordinator = Coordinator(manifest, initial, Topics("lab"), config, Store(tmp_path))
    coordinator.start(0.0)
    digest = manifest.base_digest
    honest = {}
    for i, device in enumerate(("dev0", "dev1", "dev2")):
        coordinator.handle(f"fedper/v1/lab/register/{device}", register(10 + i, digest), 0.0)
        blob = _update_blob(manifest, initial, 0.01 * (i + 1))
        meta = {"round": 1, "n_samples": 10 + i, "base_digest": digest}
        honest[device] = [frame("u1", k, len(blob), 16, blob, meta) for k in range(-(-len(blob) // 16))]
    coordinator.handle("fedper/v1/lab/register/flooder", register(10, digest), 0.0)
    for device, frames in honest.items():
        for f in frames[: len(frames) // 2]:
            assert coordinator.handle(f"fedper/v1/lab/update/{device}", f, 0.1) == []
    flood_meta = {"round": 1, "n_samples": 10, "base_digest": digest}
    answers = []
    caplog.set_level(logging.WARNING, "fedper.coordinator")
    for n in range(50_000):
        f = frame(f"f{n}", n % 4096, 4096, 1, bytes(4096), flood_meta)
        answers += coordinator.handle("fedper/v1/lab/update/flooder", f, 0.2 + n * 20 / 50_000)
    assert 3 <= len(coordinator._intake.reassembler) <= 3 + config.quotas.max_uploads_per_device
    for device, frames in honest.items():
        for f in frames[len(frames) // 2 :]:
            assert coordinator.handle(f"fedper/v1/lab/update/{device}", f, 20.5) == []
    assert sorted(coordinator.round.folded) == ["dev0", "dev1", "dev2"]
    coordinator.tick(20.6)  # counts what admit() dropped since the flood's last message
    dropped = coordinator.counters["rate_limited"]
    passed = 50_000 - dropped
    assert passed <= coordinator._intake.rate.burst + 500 * 20.5 and dropped > 30_000
    assert coordinator.counters["over_quota"] == passed - config.quotas.max_uploads_per_round
    codes = [json.loads(a.payload)["code"] for a in answers]
    assert codes.count("over_quota") == 1 and set(codes) == {"rate_limited", "over_quota"}
    assert 1 <= codes.count("rate_limited") <= 20 / REPORT_EVERY_S + 1
    assert len([r for r in caplog.records if "rate_limited flooder" in r.getMessage()]) == codes.count("rate_limited")


def test_engine_counts_what_admit_dropped_in_another_thread_at_its_next_tick(tmp_path: Path) -> None:
    """The service's network thread calls `admit` (the engine's one thread-safe method) and drops a
    flood there; the engine's thread counts every drop at its next tick and answers once, and a
    message admitted there is handled without spending a second token."""
    manifest, initial = tiny_manifest(), tiny_tensors()
    config = Config.of(rounds=1, min_clients=1, round_timeout=60, max_messages_per_second=10)
    coordinator = Coordinator(manifest, initial, Topics("lab"), config, Store(tmp_path))
    coordinator.start(0.0)
    burst = coordinator._intake.rate.burst
    topic = "fedper/v1/lab/update/flooder"
    admitted: list[bool] = []
    network = threading.Thread(target=lambda: admitted.extend(coordinator.admit(topic, 1.0) for _ in range(5_000)))
    network.start()
    network.join()
    assert admitted.count(True) == burst and coordinator.counters["rate_limited"] == 0
    answers = coordinator.tick(1.0)
    assert coordinator.counters["rate_limited"] == coordinator.round.rejected["rate_limited"] == 5_000 - burst
    assert [json.loads(a.payload)["code"] for a in answers if a.topic.endswith("/error/flooder")] == ["rate_limited"]
    assert coordinator.admit("not/a/device/topic", 1.0)  # passes: handle refuses it, counted as bad_message
    register_topic = "fedper/v1/lab/register/dev0"
    assert coordinator.admit(register_topic, 100.0)
    coordinator.handle(register_topic, register(10, manifest.base_digest), 100.0, admitted=True)
    assert "dev0" in coordinator.registered
    assert coordinator._intake.rate._buckets["dev0"].tokens == burst - 1  # one token for the message, not two
    assert coordinator._intake.rate.take_dropped() == {}


def _update_blob(manifest: Manifest, initial: dict, delta: float) -> bytes:
    """An fp32 update: safetensors written by hand (8-byte header length, JSON header, raw data)."""
    tensors = {t.name: initial[t.name] + delta for t in manifest.shared_tensors}
    header, offset, data = {}, 0, b""
    for name, value in tensors.items():
        raw = value.astype(value.dtype).tobytes()
        header[name] = {"dtype": {"float32": "F32", "int64": "I64"}[str(value.dtype)], "shape": list(value.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        offset, data = offset + len(raw), data + raw
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


# ---------------------------------------------------------------- live: processes, Mosquitto, a raw flooder


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, byte = n >> 7, n & 0x7F
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def mqtt_packet(kind: int, body: bytes) -> bytes:
    return bytes([kind]) + _varint(len(body)) + body


def mqtt_str(text: str) -> bytes:
    raw = text.encode()
    return struct.pack(">H", len(raw)) + raw


class RawFlooder:
    """An MQTT 3.1.1 client written on a socket: CONNECT, then QoS 1 PUBLISH packets sent as fast
    as the broker takes them (its PUBACKs read and thrown away). Nothing of paho or fedper."""

    def __init__(self, host: str, port: int, client_id: str) -> None:
        self.sock = socket.create_connection((host, port))
        connect = mqtt_str("MQTT") + bytes([4, 0x02]) + struct.pack(">H", 60) + mqtt_str(client_id)
        self.sock.sendall(mqtt_packet(0x10, connect))
        connack = self.sock.recv(4)
        assert connack[:2] == b"\x20\x02" and connack[3] == 0, connack
        self._mid = 0
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        try:
            while self.sock.recv(1 << 16):
                pass
        except OSError:
            pass

    def publish_all(self, topic: str, payloads: list[bytes], retain: bool = False) -> None:
        packets = bytearray()
        for payload in payloads:
            self._mid = self._mid % 65535 + 1
            body = mqtt_str(topic) + struct.pack(">H", self._mid) + payload
            packets += mqtt_packet(0x32 | (1 if retain else 0), body)
        self.sock.sendall(packets)

    def close(self) -> None:
        try:
            self.sock.sendall(b"\xe0\x00")  # DISCONNECT
        finally:
            self.sock.close()


def deploy_queue_settings() -> str:
    """The shipped broker's queue and packet limits (deploy/mosquitto/fedper.conf), for this test's broker."""
    keys = ("max_packet_size", "max_inflight_messages", "max_queued_messages", "max_queued_bytes")
    lines = DEPLOY_CONF.read_text().splitlines()
    return "\n".join(line for line in lines if line.split(" ", 1)[0] in keys)


FLOOD_RATE = 4_000  # chunks per second of the paced flood, round 1 from its opening to its deadline
BURST = 120_000  # chunks of the unpaced flood, sent as fast as one client can as round 2 opens
ROUND_TIMEOUT = 25.0


@dataclass
class FloodedRun:
    paced: int  # the flooder's one-byte chunks in round 1, at FLOOD_RATE
    burst: int  # and in round 2, all at once
    burst_s: float  # how long the burst took to publish
    records: list[dict]  # the coordinator's metrics.jsonl, one per round
    log: str  # the coordinator's


def flooded_run(broker, tmp_path: Path, artifacts: Path, processes: Processes) -> FloodedRun:
    """Two rounds with three real agents (2 KiB chunks: each upload is hundreds of messages in
    flight) while a registered device publishes one-byte chunks of never-finished blobs on its own
    update topic for the round that is open: FLOOD_RATE a second through round 1, from its opening
    until round 2 opens, then BURST chunks as fast as the broker takes them as round 2 opens."""
    fleet = "untrusted"
    manifest = Manifest.load(artifacts)
    state_dir = tmp_path / "coordinator"
    agents = []
    for i in range(3):
        data = write_device_data(tmp_path / f"d{i}.npz", (i, i + 1), 60)
        agents.append(processes.start(f"dev{i}", *agent_args(artifacts, data, broker.url, fleet, f"dev{i}",
                                                             tmp_path / f"dev{i}", "--chunk-size", "2048")))
    registered = Recorder(broker.host, broker.port, f"fedper/v1/{fleet}/register/+")
    deadline = time.monotonic() + 180  # importing torch and onnxruntime takes a while on a busy machine
    while len(registered.snapshot()) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(registered.snapshot()) == 3, [processes.log(f"dev{i}") for i in range(3)]
    registered.close()
    flooder = RawFlooder(broker.host, broker.port, "flooder")
    flooder.publish_all(f"fedper/v1/{fleet}/register/flooder", [register(10, manifest.base_digest)], retain=True)
    rounds: list[dict] = []
    recorder = Recorder(broker.host, broker.port, f"fedper/v1/{fleet}/round",
                        on_message=lambda _t, payload: rounds.append(json.loads(payload)) if payload else None)
    coordinator = processes.start("coordinator", *coordinator_args(
        artifacts, broker.url, state_dir, fleet, 2, 3, ROUND_TIMEOUT))
    deadline = time.monotonic() + 60
    while not rounds and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rounds, processes.log("coordinator")
    blob, sent = bytes(4096), 0

    def publish(round_index: int, count: int) -> None:
        nonlocal sent
        meta = {"round": round_index, "n_samples": 10, "base_digest": manifest.base_digest}
        flooder.publish_all(f"fedper/v1/{fleet}/update/flooder",
                            [frame(f"f{sent + k}", (sent + k) % 4096, len(blob), 1, blob, meta) for k in range(count)])
        sent += count

    started = time.monotonic()
    while coordinator.poll() is None and rounds[-1]["round"] == 1:
        publish(1, 500)
        time.sleep(max(0.0, started + sent / FLOOD_RATE - time.monotonic()))
    paced, started = sent, time.monotonic()
    while coordinator.poll() is None and sent < paced + BURST:
        publish(2, 500)
    burst_s = time.monotonic() - started
    assert finish(coordinator, 2 * ROUND_TIMEOUT + 30, "the coordinator", processes.log("coordinator")) == 0, \
        processes.log("coordinator")
    flooder.close()
    recorder.close()
    for i, agent in enumerate(agents):
        assert finish(agent, 30, f"dev{i}", processes.log(f"dev{i}")) == 0, processes.log(f"dev{i}")
    records = [json.loads(line) for line in (state_dir / "metrics.jsonl").read_text().splitlines()]
    print(f"flood: {paced} one-byte chunks paced in round 1, {sent - paced} in {burst_s:.1f} s in round 2; rounds: "
          f"{[(r['collect_s'], r['rejected']) for r in records]}")
    return FloodedRun(paced, sent - paced, burst_s, records, processes.log("coordinator"))


def assert_contained(run: FloodedRun, broker) -> None:
    """Every honest update folded in both rounds, each round closed at its deadline without an
    extension (the flooder is registered and never completes an update, so its deadline is what
    closes a round), the flood counted as rate_limited and logged once per window, and nothing
    dropped by the broker."""
    assert [r["devices"] for r in run.records] == [["dev0", "dev1", "dev2"]] * 2
    assert [r["deadline_extensions"] for r in run.records] == [0, 0]
    assert all(r["collect_s"] <= ROUND_TIMEOUT + 5 for r in run.records), run.records
    assert sum(r["rejected"].get("rate_limited", 0) for r in run.records) > 0
    assert 1 <= run.log.count("rate_limited flooder") <= (2 * ROUND_TIMEOUT + 30) / REPORT_EVERY_S + 2, \
        run.log[-3000:]
    assert "dropped" not in broker.log.read_text()  # "Outgoing messages are being dropped for client ..."


@pytest.mark.long
@pytest.mark.mosquitto
def test_a_device_flooding_tiny_chunks_costs_no_honest_update_and_no_deadline(
        mosquitto_factory, tmp_path: Path, tiny_artifacts: Path, processes: Processes) -> None:
    """Two floods in one run, each in its own round. Round 1: FLOOD_RATE a second from its opening to its
    deadline (at least 90,000 chunks), below the rate the coordinator drains, so the broker never holds many.
    Round 2: BURST chunks as fast as one client can publish them (several times the rate the coordinator drains)
    as the agents start training: the broker queues them for the coordinator (the shipped max_queued_messages
    holds them), whose network thread drops them above the rate limit without queueing them in the process, so
    the honest uploads queued among them are folded within the round. A flood that outpaces the coordinator for
    longer than the broker's queue lasts is beyond this: the broker then drops messages, honest ones included
    (docs/reliability.md, "Limits")."""
    broker = mosquitto_factory(deploy_queue_settings())
    run = flooded_run(broker, tmp_path, tiny_artifacts, processes)
    assert run.paced >= 0.9 * FLOOD_RATE * ROUND_TIMEOUT
    assert run.burst == BURST
    assert run.burst / run.burst_s > FLOOD_RATE
    assert_contained(run, broker)
