"""A half-open upload flood: does one hostile device push honest uploads past a round's deadline?

    python benchmarks/upload_flood.py [--quick] [--out runs/bench]

A real Mosquitto 2 (deploy/'s queue and packet limits, on loopback), the coordinator as its own process
(`python -m fedper.coordinator.cli --verbose`, default quotas), 8 honest scripted devices uploading a
400 KB update in 2 KiB chunks (196 messages each, QoS 1) at a random 0-2 s into each round, and one
registered hostile device: a raw paho client (MQTT 3.1.1, no inflight limit) that publishes, paced at
`rate` messages a second, the first chunk of ever new update blobs it never finishes (hand-built
frames: json, struct, zlib, hashlib; the honest blob's size and chunk size, so each opens a 400 KB
reassembly). Each phase runs the same rounds with another flood rate, 0 first (the baseline); one 5,000/s
phase lifts --max-uploads-per-round (the flood's every blob then reaches the engine, as before the quota).

Measured per phase: every honest update's lag, from the broker's PUBACK of its last chunk (at the
device) to its fold (the coordinator's verbose log, milliseconds); whether it was folded in its round
(else it was pushed past the deadline: refused `late_update` or missing); deadline extensions; the
flood the broker took (its PUBACKs at the flooder: paho queues what it cannot send) and that rate; the
coordinator's `rate_limited` and `over_quota` counters, CPU and wall seconds; whether Mosquitto dropped
messages for the coordinator; the 1-minute load average before and after (this machine may be shared:
compare phases within one run, not runs).
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import multiprocessing as mp
import os
import random
import re
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import fleet_scale
import numpy as np
from common import main, table, write_json
from fleet_scale import MiniMqtt, cpu_seconds, exited, filled, manifest_of
from helpers.toy_export import write_toy_export  # fleet_scale put tests/ on the path: the tests' toy export

from fedper.payload import encode_shared
from fedper.ports import free_port
from fedper.wire import ErrorMessage, Register, RoundInfo, Topics, UpdateMeta, chunk

FLEET = "flood"
HONEST = 8
CHUNK = 2048
FLOATS = 100_000
DEPLOY_CONF = Path(__file__).resolve().parents[1] / "deploy" / "mosquitto" / "fedper.conf"
ACCEPTED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) round (\d+): accepted (\S+) ")


def start_mosquitto(directory: Path, port: int) -> subprocess.Popen[bytes]:
    """Mosquitto on loopback with the shipped queue and packet limits (deploy/mosquitto/fedper.conf)."""
    keys = ("max_packet_size", "max_inflight_messages", "max_queued_messages", "max_queued_bytes")
    shipped = [line for line in DEPLOY_CONF.read_text().splitlines() if line.split(" ", 1)[0] in keys]
    user = "user root\n" if os.geteuid() == 0 else ""
    conf = directory / "mosquitto.conf"
    logging = f"log_type error\nlog_type warning\nlog_dest file {directory / 'broker.log'}\n"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n{user}"
                    + "\n".join(shipped) + "\n" + logging)
    return fleet_scale.start_broker(conf, port)


# ------------------------------------------------------------ the honest devices (one process, asyncio)


async def _honest(port: int, rounds: int, train_s: float, ready: Any, stop: Any) -> dict[str, Any]:
    manifest, topics = manifest_of(FLOATS), Topics(FLEET)
    acked: dict[str, float] = {}  # "round/device" -> when the broker acknowledged the update's last chunk
    errors: dict[str, list[str]] = {}
    clients = []

    async def upload(client: MiniMqtt, round_: int, value: float) -> None:
        await asyncio.sleep(random.uniform(0, train_s))
        blob = encode_shared(manifest, filled(manifest, value))
        meta = UpdateMeta(round_, 10, manifest.base_digest, {"accuracy": value}).to_dict()
        frames = chunk(blob, CHUNK, f"r{round_}-{client.client_id}", meta)
        await asyncio.gather(*[client.publish(topics.update(client.client_id), f) for f in frames])
        acked[f"{round_}/{client.client_id}"] = time.time()

    def device(index: int) -> MiniMqtt:
        name, answered = f"honest-{index}", set()
        client = MiniMqtt(name)

        def on_message(topic: str, payload: bytes) -> None:
            if not payload:
                return
            if topic == topics.round:
                info = RoundInfo.decode(payload)
                if info.state == "open" and info.round not in answered:
                    answered.add(info.round)
                    asyncio.get_running_loop().create_task(upload(client, info.round, (index + 1) / 10))
            else:
                errors.setdefault(name, []).append(ErrorMessage.decode(payload).code)

        client.on_message = on_message
        return client

    for i in range(HONEST):
        client = device(i)
        await client.connect("127.0.0.1", port, will=(topics.presence(client.client_id), b"offline"))
        await client.subscribe([topics.round, topics.error(client.client_id)])
        client.publish(topics.register(client.client_id), Register(10, manifest.base_digest, "bench/1").encode(),
                       retain=True)
        client.publish(topics.presence(client.client_id), b"online", retain=True)
        clients.append(client)
    ready.put(True)
    while not stop.is_set():
        await asyncio.sleep(0.1)
    for client in clients:
        await client.disconnect()
    return {"acked": acked, "errors": errors}


def _honest_process(port: int, rounds: int, train_s: float, ready: Any, stop: Any, results: Any) -> None:
    results.put(asyncio.run(_honest(port, rounds, train_s, ready, stop)))


# ------------------------------------------------------------ the hostile device: a raw paho client


def half_open_frame(blob_id: str, size: int, round_: int, digest: str) -> bytes:
    """Chunk 0 of a blob of `size` bytes in CHUNK-byte chunks, written by hand (docs/protocol.md, section 5):
    u32 header length, u32 crc32 of header + data, JSON header, data. The rest never follows."""
    data = os.urandom(CHUNK)
    header = json.dumps({"v": 1, "blob_id": blob_id, "index": 0, "count": -(-size // CHUNK), "size": size,
                         "chunk_size": CHUNK, "sha256": hashlib.sha256(blob_id.encode()).hexdigest(),
                         "meta": {"round": round_, "n_samples": 10, "base_digest": digest}},
                        separators=(",", ":")).encode()
    return struct.pack(">II", len(header), zlib.crc32(header + data)) + header + data


def _flooder(port: int, rate: float, size: int, digest: str, started: Any, stop: Any, results: Any) -> None:
    """Register, then publish half-open uploads at `rate` a second for the round that is open, until `stop`."""
    import paho.mqtt.client as mqtt

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="flooder", protocol=mqtt.MQTTv311)
    client.max_inflight_messages_set(0)  # no client-side limit: as fast as the broker takes them
    client.max_queued_messages_set(0)
    topics, state = Topics(FLEET), {"round": 1, "acked": 0}

    def on_message(_client: Any, _userdata: Any, msg: Any) -> None:
        if msg.payload:
            state["round"] = json.loads(msg.payload)["round"]

    def on_publish(*_args: Any) -> None:
        state["acked"] += 1  # the broker took it (its PUBACK): paho may queue what it cannot send yet

    client.on_message, client.on_publish = on_message, on_publish
    client.connect("127.0.0.1", port)
    client.loop_start()
    client.subscribe(topics.round, 1)
    register = json.dumps({"v": 1, "n_samples": 10, "base_digest": digest, "software": "flooder/1"}).encode()
    client.publish(topics.register("flooder"), register, qos=1, retain=True).wait_for_publish(10)
    started.wait()
    sent, begin, batch = 0, time.monotonic(), max(1, int(rate / 200))  # 200 batches a second
    while not stop.is_set():
        for _ in range(batch):
            client.publish(topics.update("flooder"), half_open_frame(f"f{sent}", size, state["round"], digest), qos=1)
            sent += 1
        time.sleep(max(0.0, begin + sent / rate - time.monotonic()))
    elapsed = time.monotonic() - begin
    acked = state["acked"] - 1  # the registration's
    client.loop_stop()
    client.disconnect()
    results.put({"sent": sent, "acked": acked, "seconds": elapsed})


# ------------------------------------------------------------ one phase


def _folds(log: str) -> dict[str, float]:
    """'round/device' -> unix time of its fold, from the coordinator's verbose log (local time, milliseconds)."""
    folds = {}
    for line in log.splitlines():
        match = ACCEPTED.match(line)
        if match:
            when = datetime.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            folds[f"{match[2]}/{match[3]}"] = when
    return folds


def run_phase(rate: float, rounds: int, round_timeout: float, directory: Path, *options: str) -> dict[str, Any]:
    """`rounds` rounds with a flood of `rate` messages a second (0: none); `options`: the coordinator's, added."""
    directory.mkdir(parents=True)
    manifest = manifest_of(FLOATS)
    artifacts, state_dir = directory / "export", directory / "state"
    write_toy_export(artifacts, manifest, filled(manifest, 0.0))  # the coordinator verifies its export at start
    blob = encode_shared(manifest, filled(manifest, 0.0))
    port = free_port()
    broker = start_mosquitto(directory, port)
    context = mp.get_context("fork")
    ready, results, stop, started = context.Queue(), context.Queue(), context.Event(), context.Event()
    honest = context.Process(target=_honest_process, args=(port, rounds, 2.0, ready, stop, results), daemon=True)
    flood_results = context.Queue()
    flooder = context.Process(target=_flooder, args=(port, rate, len(blob), manifest.base_digest, started, stop,
                                                     flood_results), daemon=True) if rate else None
    coordinator = None
    load_before = os.getloadavg()[0]
    try:
        honest.start()
        ready.get(timeout=60)
        if flooder:
            flooder.start()
        log = open(directory / "coordinator.log", "wb")  # noqa: SIM115 (closed with the process)
        launched = time.monotonic()
        coordinator = subprocess.Popen(
            [sys.executable, "-m", "fedper.coordinator.cli", "--artifacts", str(artifacts), "--fleet", FLEET,
             "--broker", f"mqtt://127.0.0.1:{port}", "--rounds", str(rounds), "--min-clients", str(HONEST),
             "--round-timeout", str(round_timeout), "--chunk-size", str(CHUNK), "--state-dir", str(state_dir),
             "--verbose", *options], stdout=log, stderr=subprocess.STDOUT)
        time.sleep(1.0)  # the coordinator takes in the registrations; then the flood starts
        started.set()
        deadline = time.monotonic() + rounds * (round_timeout + 30) + 60
        cpu = 0.0
        while not exited(coordinator.pid) and time.monotonic() < deadline:
            cpu = cpu_seconds(coordinator.pid)
            time.sleep(0.2)
        finished = exited(coordinator.pid)
        if not finished:
            coordinator.kill()  # the flood held it past every deadline: reported as such
        _, status, usage = os.wait4(coordinator.pid, 0)
        duration = time.monotonic() - launched
        coordinator.returncode = os.waitstatus_to_exitcode(status)
        log.close()
        stop.set()
        flood = flood_results.get(timeout=60) if flooder else {"sent": 0, "acked": 0, "seconds": 0.0}
        devices = results.get(timeout=60)
    finally:
        stop.set()
        started.set()
        for proc in (honest, flooder):
            if proc is not None:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
        if coordinator and coordinator.poll() is None:
            coordinator.kill()
        broker.terminate()
        broker.wait(10)
    text = (directory / "coordinator.log").read_text(errors="replace")
    if finished and coordinator.returncode != 0:
        raise RuntimeError(f"coordinator exited {coordinator.returncode}: {text[-2000:]}")
    cpu = usage.ru_utime + usage.ru_stime or cpu
    metrics = state_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    counters = json.loads((state_dir / "state.json").read_text())["counters"]
    folds = _folds(text)
    in_round = {f"{r['round']}/{d}" for r in records for d in r["devices"]}
    lags = [folds[k] - devices["acked"][k] for k in devices["acked"] if k in folds]
    late = sorted(set(devices["acked"]) - in_round)
    return {
        "flood_rate": rate, "options": " ".join(options), "rounds": rounds, "rounds_closed": len(records),
        "finished": finished,
        "round_timeout_s": round_timeout,
        "flood_published": flood["sent"], "flood_acked": flood["acked"],
        "flood_rate_achieved": round(flood["acked"] / flood["seconds"], 1) if flood["seconds"] else 0.0,
        "honest_sent": len(devices["acked"]), "honest_folded_in_round": len(set(devices["acked"]) & in_round),
        "honest_late": late, "device_errors": devices["errors"],
        "extensions": sum(r["deadline_extensions"] for r in records),
        "lag_median_s": round(float(np.median(lags)), 3) if lags else None,
        "lag_p95_s": round(float(np.percentile(lags, 95)), 3) if lags else None,
        "lag_max_s": round(max(lags), 3) if lags else None,
        "rate_limited": counters.get("rate_limited", 0), "over_quota": counters.get("over_quota", 0),
        "flood_handled_per_s": round((counters.get("rate_limited", 0) + counters.get("over_quota", 0)) / duration, 1)
        if duration else None,
        "coordinator_cpu_s": round(cpu, 2), "coordinator_wall_s": round(duration, 1),
        "coordinator_log_lines": text.count("\n"),
        "broker_dropped": "dropped" in (directory / "broker.log").read_text(errors="replace"),
        "load_1min_before": round(load_before, 2), "load_1min_after": round(os.getloadavg()[0], 2),
    }


def run(out: Path, quick: bool) -> str:
    lifted = ("--max-uploads-per-round", "1000000000")
    phases = [(0, ()), (5_000, lifted), (5_000, ())] + ([] if quick else [(10_000, ())])
    rounds, round_timeout = (2, 8.0) if quick else (4, 8.0)
    results = []
    with tempfile.TemporaryDirectory(prefix="flood-") as tmp:
        for i, (rate, options) in enumerate(phases):
            results.append(run_phase(rate, rounds, round_timeout, Path(tmp) / f"phase{i}", *options))
            print(f"  flood {rate}/s {' '.join(options)} done", file=sys.stderr, flush=True)
    write_json(out, "upload_flood", {"honest_devices": HONEST, "chunk_size": CHUNK, "model_floats": FLOATS,
                                     "results": results})
    header = ["flood msg/s (broker took)", "options", "rounds closed", "honest folded in round", "extensions",
              "lag median / p95 / max s", "rate_limited / over_quota", "coord. CPU / wall s", "coord. log lines",
              "broker dropped", "load before/after"]
    rows = [[f"{r['flood_rate']} ({r['flood_rate_achieved']})", r["options"] or "default",
             f"{r['rounds_closed']}/{r['rounds']}",
             f"{r['honest_folded_in_round']}/{r['honest_sent']}",
             r["extensions"], f"{r['lag_median_s']} / {r['lag_p95_s']} / {r['lag_max_s']}",
             f"{r['rate_limited']} / {r['over_quota']}",
             f"{r['coordinator_cpu_s']} / {r['coordinator_wall_s']}", r["coordinator_log_lines"], r["broker_dropped"],
             f"{r['load_1min_before']}/{r['load_1min_after']}"] for r in results]
    return table(header, rows)


if __name__ == "__main__":
    main(run, __doc__, quick="rates 0 and 5,000 a second, 2 rounds")
