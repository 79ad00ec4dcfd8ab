"""One hostile device cannot stop a secure fleet: secure-aggregation rounds closed per minute with 10 devices
on a loopback Mosquitto, clean against one hostile device among them, in one run.

The coordinator is the real service (fedper.coordinator.service over MQTT, --secure-aggregation, min group 3);
the devices are paho clients, each answering its relayed stages with the device's own SecureParticipant, with
no training (each sends the same clipped delta every round), so the rounds measure the protocol alone. The
hostile device takes part with a valid identity and, every round:

- bad shares: replaces each of its stage-2 ciphertexts with random bytes of the same size (before issue 26 this
  failed every session: 11 failed sessions in 60 s, no round closed);
- poisoned: masks the clip norm C in every value (L2 norm C * sqrt(length), beyond its clip norm), so the sum of
  its group fails its check (before issue 26 every round closed with the model unchanged).

Per scenario: rounds closed in the window, per minute and against the clean fleet, the rounds whose model
moved (a group released), and the round at which the poisoner was excluded. The clean fleet runs first and
last, and the ratios are against the mean of its two rates.

    python benchmarks/secagg_hostile.py [--quick] [--out runs/bench]
"""

from __future__ import annotations

import base64
import json
import logging
import secrets
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import main, table, write_json
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedper.coordinator.config import Config
from fedper.coordinator.durable import Coordinator
from fedper.coordinator.service import run_service
from fedper.coordinator.store import Store
from fedper.edge.secure_round import SecureParticipant
from fedper.manifest import Manifest, ModelInfo, TensorSpec
from fedper.mqtt import connect_async, make_client, parse_broker_url
from fedper.payload import decode_shared, max_blob_size
from fedper.secagg import ROOT_FILE, Identity
from fedper.wire import (
    SECAGG_CODEC,
    SECAGG_DOWN,
    Reassembler,
    Register,
    RoundInfo,
    Topics,
    UpdateMeta,
    chunk,
    decode_secagg,
)

TOPICS = Topics("bench")
DEVICES = 10
LENGTH = 10_000
CLIP = 1.0
WINDOW_S = 60.0  # --quick: 15
SCENARIOS = ("clean", "bad shares", "poisoned")


def flat_manifest(length: int) -> Manifest:
    info = ModelInfo("flat", kp=1, num_classes=1, input_shape=(1, 1, 1), mean=(0.0,) * 3, std=(1.0,) * 3)
    return Manifest(model=info, algorithm="fedper", tensors=(
        TensorSpec("base", (length,), "float32", "base", True, shared=True),
        TensorSpec("head", (1,), "float32", "head", True, shared=False)))


class Device:
    """A paho client that takes part in each round's session with its SecureParticipant; `hostile` is None,
    "bad shares" or "poisoned"."""

    def __init__(self, url: str, name: str, index: int, manifest: Manifest, identity: Path, state: Path,
                 hostile: str | None) -> None:
        self.name, self.index, self.manifest, self.identity, self.state = name, index, manifest, identity, state
        self.hostile = hostile
        self.n_samples = 100 + 10 * index
        self.delta = np.float32(0.3 / np.sqrt(LENGTH) * (1 + index % 3))
        self.participant: SecureParticipant | None = None
        self.info: RoundInfo | None = None
        self.models: dict[str, bytes] = {}
        self.reassembler = Reassembler(max_blob_size(manifest))
        self.lock = threading.Lock()
        self.client = make_client(f"bench-{name}", will=(TOPICS.presence(name), b"offline"))
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        connect_async(self.client, parse_broker_url(url))

    def _on_connect(self, client, userdata, flags, reason, props) -> None:  # type: ignore[no-untyped-def]
        client.subscribe([(TOPICS.round, 1), (f"{TOPICS.base}/model/#", 1), (TOPICS.relay(self.name), 1)])
        client.publish(TOPICS.presence(self.name), b"online", qos=1, retain=True)
        client.publish(TOPICS.register(self.name), Register(self.n_samples, self.manifest.base_digest,
                                                            "bench/1").encode(), qos=1, retain=True)

    def _on_message(self, client, userdata, msg) -> None:  # type: ignore[no-untyped-def]
        with self.lock:
            if msg.topic == TOPICS.round:
                self.info = RoundInfo.decode(msg.payload)
            elif msg.topic == TOPICS.relay(self.name):
                self._relayed(bytes(msg.payload))
                return
            elif msg.payload:
                blob = self.reassembler.add("coordinator", bytes(msg.payload))
                if blob is not None:
                    self.models[blob.blob_id] = blob.data
            self._advertise()

    def _advertise(self) -> None:
        info = self.info
        if info is None or info.state != "open" or info.secagg_session is None or info.blob_id not in self.models:
            return
        current = self.participant
        if current is not None and (current.round, current.session) == (info.round, info.secagg_session):
            return
        model = decode_shared(self.manifest, self.models[info.blob_id])
        update = {"base": model["base"] + self.delta}
        meta = UpdateMeta(round=info.round, n_samples=self.n_samples, base_digest=self.manifest.base_digest,
                          codec=SECAGG_CODEC)
        self.participant = SecureParticipant(TOPICS, self.name, info.round, info.secagg_session, self.manifest,
                                             update, model, self.n_samples, meta, 63 * 1024, self.identity,
                                             self.state, info.sha256)
        try:
            self._send([self.participant.advertise()])
        except Exception:  # excluded, or a round already answered: sit this session out
            return

    def _relayed(self, payload: bytes) -> None:
        participant = self.participant
        if participant is None:
            return
        message = decode_secagg(payload, SECAGG_DOWN)
        try:
            if self.hostile == "poisoned" and message.stage == "mask" and participant.client is not None:
                masked = participant.client.masked_input(message, np.full(LENGTH, CLIP))
                frames = chunk(masked.to_safetensors(), 63 * 1024, f"p{participant.session}",
                               participant.meta.to_dict())
                for frame in frames:
                    self.client.publish(TOPICS.update(self.name), frame, qos=1)
                return
            out = participant.handle(message)
        except Exception:  # a refusal: nothing sent for this stage
            return
        if self.hostile == "bad shares" and message.stage == "neighbours":
            body = json.loads(out[0].payload)
            body["shares"] = {k: base64.b64encode(secrets.token_bytes(len(base64.b64decode(v)))).decode()
                              for k, v in body["shares"].items()}
            out[0] = type(out[0])(out[0].topic, json.dumps(body).encode())
        self._send(out)

    def _send(self, out: list[Any]) -> None:
        for message in out:
            self.client.publish(message.topic, message.payload, qos=1)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def scenario(url: str, directory: Path, hostile: str | None, window: float) -> dict[str, Any]:
    manifest = flat_manifest(LENGTH)
    root = Ed25519PrivateKey.generate()
    names = [f"d{i:02d}" for i in range(DEVICES)]
    ids = {name: Identity.issue(root, TOPICS.fleet, name).save(directory / "id" / name) for name in names}
    initial = {"base": np.random.default_rng(0).normal(0, 1, LENGTH).astype(np.float32)}
    config = Config.of(rounds=100_000, min_clients=2, round_timeout=30.0, secure_aggregation=True, clip_norm=CLIP,
                       secagg_stage_timeout=5.0, secagg_identity_root=str(ids[names[0]] / ROOT_FILE),
                       secagg_min_group=3, max_messages_per_second=1e6)
    coordinator = Coordinator(manifest, initial, TOPICS, config, Store(directory / "coordinator"))
    devices = []
    for i, name in enumerate(names):
        (directory / "state" / name).mkdir(parents=True)
        devices.append(Device(url, name, i, manifest, ids[name], directory / "state" / name,
                              hostile if i == DEVICES - 3 else None))
    while sum(d.client.is_connected() for d in devices) < DEVICES:
        time.sleep(0.05)
    time.sleep(0.5)  # registrations reach the broker before the first round opens
    stop = threading.Event()
    service = threading.Thread(target=run_service, args=(coordinator, parse_broker_url(url)), kwargs={"stop": stop},
                               daemon=True)
    started = time.perf_counter()
    service.start()
    time.sleep(window)
    stop.set()
    service.join(30)
    elapsed = time.perf_counter() - started
    for device in devices:
        device.close()
    metrics = directory / "coordinator" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    excluded = [r["round"] for r in records if r["secagg"]["excluded"]]
    return {"scenario": hostile or "clean", "rounds": len(records), "seconds": elapsed,
            "per_minute": 60 * len(records) / elapsed,
            "released": sum(1 for r in records if r["devices"]),
            "failed_sessions": coordinator.strategy.failures,
            "excluded_at": excluded[0] if excluded else None,
            "reported": sorted({d for r in records for d in r["secagg"]["reported"]})}


def run(out: Path, quick: bool = False) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from conftest import MOSQUITTO, Broker  # the test suite's Mosquitto launcher

    if MOSQUITTO is None:
        raise SystemExit("secagg_hostile: mosquitto is not installed (apt-get install mosquitto)")
    logging.getLogger("fedper.coordinator").setLevel(logging.ERROR)  # each refusal of the excluded device
    window = 15.0 if quick else WINDOW_S
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # the clean fleet first and last: the machine's load drifts. A broker each: the last scenario's retained
        # stage messages (a session of another coordinator) would reach the next scenario's devices first
        for i, hostile in enumerate((None, "bad shares", "poisoned", None)):
            (Path(tmp) / f"broker{i}").mkdir()
            broker = Broker(Path(tmp) / f"broker{i}", extra_conf="max_queued_messages 10000")
            broker.start()
            try:
                rows.append(scenario(broker.url, Path(tmp) / str(i), hostile, window))
            finally:
                broker.stop()
    clean = (rows[0]["per_minute"] + rows[-1]["per_minute"]) / 2
    write_json(out, "secagg_hostile", {"devices": DEVICES, "length": LENGTH, "window_s": window, "rows": rows})
    return (f"{DEVICES} devices, {LENGTH:,} values, loopback Mosquitto, {window:.0f} s per scenario\n\n" + table(
        ["scenario", "rounds closed", "per minute", "vs clean", "rounds released", "failed sessions",
         "hostile excluded at round", "reported"],
        [[r["scenario"], r["rounds"], r["per_minute"], r["per_minute"] / clean, r["released"], r["failed_sessions"],
          r["excluded_at"] or "-", ", ".join(r["reported"]) or "-"] for r in rows]))


if __name__ == "__main__":
    main(run, __doc__, quick="15 s per scenario")
