"""End-to-end round latency: the coordinator service and 10 scripted devices on a loopback Mosquitto.

Devices are paho clients speaking protocol v1 through fedper.wire (like tests/test_coordinator_live.py).
Local training is simulated with a fixed sleep, so the other phases stand out. Per round:
broadcast (round announced -> last device holds the whole base model), local training (the
sleep), upload (publishing every update chunk, QoS 1 acknowledged), the coordinator's folding of
what is still queued after the last upload, and aggregation (the coordinator's metrics.jsonl).

    python benchmarks/round_latency.py [--quick] [--out runs/bench]
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import main, median, table, write_json

from fedper.coordinator.config import Config
from fedper.coordinator.durable import Coordinator
from fedper.coordinator.service import run_service
from fedper.coordinator.store import Store
from fedper.manifest import Manifest
from fedper.models import build_model, describe, exported_state
from fedper.mqtt import connect_async, make_client, parse_broker_url
from fedper.payload import decode_shared, encode_shared, max_blob_size
from fedper.wire import (
    Reassembler,
    Register,
    RoundInfo,
    Topics,
    UpdateMeta,
    chunk,
)

TOPICS = Topics("bench")
TRAIN_S = 0.5


class Device:
    """Registers, then answers each open round with base + 0.001 after a simulated training sleep."""

    def __init__(self, url: str, name: str, manifest: Manifest) -> None:
        self.name, self.manifest = name, manifest
        self.timings: dict[int, dict[str, float]] = {}
        self._latest: RoundInfo | None = None
        self._blobs: dict[str, bytes] = {}
        self._reassembler = Reassembler(max_blob_size(manifest))
        self.client = make_client(f"bench-{name}", will=(TOPICS.presence(name), b"offline"))
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        connect_async(self.client, parse_broker_url(url))

    def _on_connect(self, client, userdata, flags, reason, props) -> None:  # type: ignore[no-untyped-def]
        client.subscribe([(TOPICS.round, 1), (f"{TOPICS.base}/model/#", 1)])
        client.publish(TOPICS.presence(self.name), b"online", qos=1, retain=True)
        client.publish(TOPICS.register(self.name), Register(100, self.manifest.base_digest, "bench/1").encode(),
                       qos=1, retain=True)

    def _on_message(self, client, userdata, msg) -> None:  # type: ignore[no-untyped-def]
        if msg.topic == TOPICS.round:
            self._latest = RoundInfo.decode(msg.payload)
            self.timings.setdefault(self._latest.round, {"announced": time.perf_counter()})
        elif msg.payload:
            blob = self._reassembler.add("coordinator", bytes(msg.payload))
            if blob is not None:
                self._blobs[blob.blob_id] = blob.data
        info = self._latest
        if info and info.state == "open" and info.blob_id in self._blobs and "received" not in self.timings[info.round]:
            self.timings[info.round]["received"] = time.perf_counter()
            base = decode_shared(self.manifest, self._blobs[info.blob_id])
            threading.Thread(target=self._train_and_send, args=(info.round, base), daemon=True).start()

    def _train_and_send(self, round_: int, base: dict[str, np.ndarray]) -> None:
        time.sleep(TRAIN_S)
        marks = self.timings[round_]
        marks["trained"] = time.perf_counter()
        update = {k: v + np.float32(1e-3) for k, v in base.items()}
        meta = UpdateMeta(round_, 100, self.manifest.base_digest, {"accuracy": 0.5})
        infos = [self.client.publish(TOPICS.update(self.name), frame, qos=1)
                 for frame in chunk(encode_shared(self.manifest, update), blob_id=f"r{round_}-{self.name}",
                                    meta=meta.to_dict())]
        for info in infos:
            info.wait_for_publish(60)
        marks["uploaded"] = time.perf_counter()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def measure(width: float, devices: int, rounds: int) -> tuple[list[dict[str, Any]], int]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from conftest import MOSQUITTO, Broker  # the test suite's Mosquitto launcher

    if MOSQUITTO is None:
        raise SystemExit("round_latency: mosquitto is not installed (apt-get install mosquitto)")
    net = build_model("mobilenet_v1", 10, width, 32)
    manifest = describe(net, architecture="mobilenet_v1", kp=1, algorithm="fedper", input_size=32, width=width)
    state = exported_state(net)
    initial = {n: state[n].detach().numpy() for n in manifest.names(shared=True)}
    with tempfile.TemporaryDirectory() as tmp:
        # Mosquitto's default per-client queue (1000 messages) is smaller than 10 updates' chunks
        # queued for a coordinator that folds one update at a time.
        broker = Broker(Path(tmp), extra_conf="max_queued_messages 10000")
        broker.start()
        try:
            state_dir = Path(tmp) / "state"
            config = Config.of(rounds=rounds, min_clients=devices, round_timeout=300.0)
            coordinator = Coordinator(manifest, initial, TOPICS, config, Store(state_dir))
            fleet = [Device(broker.url, f"d{i:02d}", manifest) for i in range(devices)]
            while sum(1 for d in fleet if d.client.is_connected()) < devices:
                time.sleep(0.05)
            time.sleep(0.5)  # registrations reach the broker before the first round opens
            service = threading.Thread(target=run_service, args=(coordinator, parse_broker_url(broker.url)),
                                       daemon=True)
            service.start()
            service.join(600)
            for d in fleet:
                d.close()
            records = [json.loads(line) for line in (state_dir / "metrics.jsonl").read_text().splitlines()]
        finally:
            broker.stop()
    rows = []
    for record in records:
        k = record["round"]
        marks = [d.timings[k] for d in fleet]
        announced = min(m["announced"] for m in marks)
        last_upload = max(m["uploaded"] for m in marks)
        rows.append({
            "round": k, "devices": devices, "round_s": record["collect_s"] + record["aggregate_s"],
            "broadcast_publish_s": record["broadcast_s"],
            "broadcast_s": max(m["received"] for m in marks) - announced,
            "training_s": median([m["trained"] - m["received"] for m in marks]),
            "upload_s": median([m["uploaded"] - m["trained"] for m in marks]),
            "upload_last_s": max(m["uploaded"] - m["trained"] for m in marks),
            "fold_after_last_upload_s": max(0.0, announced + record["collect_s"] - last_upload),
            "aggregate_s": record["aggregate_s"],
        })
    return rows, sum(v.nbytes for v in initial.values())


def run(out: Path, quick: bool = False) -> str:
    width = 0.25 if quick else 1.0
    rows, size = measure(width, devices=10, rounds=1 if quick else 2)
    write_json(out, "round_latency", {"model": f"mobilenet_v1 w{width} K_P=1", "model_bytes": size,
                                      "simulated_training_s": TRAIN_S, "rounds": rows})
    header = ["round", "round s", "broadcast s (to last device)", "training s (sleep)", "upload s (median)",
              "upload s (slowest)", "folding after last upload s", "aggregation s"]
    text = f"10 devices, MobileNet-v1 w{width} ({size / 1e6:.1f} MB shared), loopback Mosquitto\n\n"
    return text + table(header, [[r["round"], r["round_s"], r["broadcast_s"], r["training_s"], r["upload_s"],
                                  r["upload_last_s"], r["fold_after_last_upload_s"], r["aggregate_s"]] for r in rows])


if __name__ == "__main__":
    main(run, __doc__, quick="MobileNet-v1 w0.25, one round")
