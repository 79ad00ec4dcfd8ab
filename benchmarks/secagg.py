"""Secure aggregation over MQTT against the plain protocol: bytes and seconds per device and for the
coordinator at 10 / 50 / 100 devices, in one run.

Both protocols run through the real engines, without a broker: the coordinator's (fedper.coordinator.durable,
its state directory in a temporary folder, so checkpoints count) and, for secure aggregation, each
device's SecureParticipant (fedper.edge.secure_round); every message crosses as the bytes MQTT would carry
(JSON stage messages, chunk frames of the update or the masked input). The model is one shared tensor of
LENGTH values. Per device: bytes up and down (the round's model and RoundInfo, the same in both modes,
are not counted), and the seconds of its own work (plain: encoding and chunking its update; secure: its
stages, clipping, quantization, masking and signing included; not the training). The coordinator: the
seconds of its handle() and tick() calls from the first device message to the round's close (verifying every
advert and signature included). 10 % of the devices drop after sharing their keys and before their share
report, the costly case (their pairwise masks are rebuilt); in the plain protocol they simply send nothing.
Neighbour degree and threshold: fedper.secagg's defaults. The consistency check's bytes (the survivor set
and the signatures of more than half of the session, to each device) are in the down column.

    python benchmarks/secagg.py [--quick] [--out runs/bench]
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from common import main, table, write_json
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedper.coordinator.config import Config
from fedper.coordinator.durable import Coordinator
from fedper.coordinator.store import Store
from fedper.edge.secure_round import SecureParticipant
from fedper.manifest import Manifest, ModelInfo, TensorSpec
from fedper.payload import encode_shared
from fedper.secagg import ROOT_FILE, Identity
from fedper.wire import (
    SECAGG_CODEC,
    SECAGG_DOWN,
    Outgoing,
    Register,
    RoundInfo,
    Topics,
    UpdateMeta,
    chunk,
    decode_secagg,
)

DEVICES = (10, 50, 100)
LENGTH = 1_000_000  # --quick: 20,000
DROPPED = 0.10
CLIP = 0.5
TOPICS = Topics("bench")


def flat_manifest(length: int) -> Manifest:
    """A model of one shared tensor of `length` values and a one-value head."""
    info = ModelInfo("flat", kp=1, num_classes=1, input_shape=(1, 1, 1), mean=(0.0,) * 3, std=(1.0,) * 3)
    tensors = (TensorSpec("base", (length,), "float32", "base", True, shared=True),
               TensorSpec("head", (1,), "float32", "head", True, shared=False))
    return Manifest(model=info, algorithm="fedper", tensors=tensors)


class Traffic:
    """Bytes and seconds per device and for the coordinator."""

    def __init__(self, devices: list[str]) -> None:
        self.up = dict.fromkeys(devices, 0)
        self.down = dict.fromkeys(devices, 0)
        self.device_s = dict.fromkeys(devices, 0.0)
        self.coordinator_s = 0.0

    def on_device(self, device: str, work: Callable[[], list[Outgoing]]) -> list[Outgoing]:
        start = time.perf_counter()
        out = work()
        self.device_s[device] += time.perf_counter() - start
        self.up[device] += sum(len(m.payload) for m in out)
        return out

    def on_coordinator(self, work: Callable[[], list[Outgoing]]) -> list[Outgoing]:
        start = time.perf_counter()
        out = work()
        self.coordinator_s += time.perf_counter() - start
        return out


def fleet(devices: int, length: int, seed: int) -> tuple[Manifest, dict[str, np.ndarray], dict[str, Any], set[str]]:
    manifest = flat_manifest(length)
    rng = np.random.default_rng(seed)
    model = {"base": rng.normal(0, 1, length).astype(np.float32)}
    names = [f"d{j:03d}" for j in range(devices)]
    updates = {d: {"base": model["base"] + rng.normal(0, 0.3 / np.sqrt(length), length).astype(np.float32)}
               for d in names}
    dropped = set(rng.choice(names, max(1, round(DROPPED * devices)), replace=False).tolist())
    return manifest, model, updates, dropped


def identities(directory: Path, names: list[str]) -> dict[str, Path]:
    """Each device's identity directory, certified by one fresh fleet root (its public key beside them)."""
    root = Ed25519PrivateKey.generate()
    return {name: Identity.issue(root, TOPICS.fleet, name).save(directory / name) for name in names}


def start(manifest: Manifest, model: dict[str, np.ndarray], state: Path, names: list[str], secure: bool,
          traffic: Traffic, root: Path | None = None) -> tuple[Coordinator, list[Outgoing]]:
    config = Config.of(rounds=1, min_clients=2, round_timeout=3600.0, secure_aggregation=secure,
                       clip_norm=CLIP if secure else None, max_messages_per_second=1e9,
                       secagg_identity_root=str(root) if root else None)
    coordinator = Coordinator(manifest, model, TOPICS, config, Store(state))
    announced = coordinator.start(time.time())
    for j, name in enumerate(names):
        register = Register(n_samples=100 + j, base_digest=manifest.base_digest, software="bench")
        traffic.on_coordinator(lambda n=name, r=register: coordinator.handle(TOPICS.register(n), r.encode(),
                                                                             time.time()))
    return coordinator, announced


def plain_round(devices: int, length: int, seed: int) -> Traffic:
    manifest, model, updates, dropped = fleet(devices, length, seed)
    names = sorted(updates)
    traffic = Traffic(names)
    with tempfile.TemporaryDirectory() as state:
        coordinator, _ = start(manifest, model, Path(state), names, False, traffic)
        for j, name in enumerate(names):
            if name in dropped:
                continue
            meta = UpdateMeta(round=1, n_samples=100 + j, base_digest=manifest.base_digest)
            frames = traffic.on_device(name, lambda n=name, m=meta: [
                Outgoing(TOPICS.update(n), f) for f in chunk(encode_shared(manifest, updates[n]), blob_id="u",
                                                             meta=m.to_dict())])
            for frame in frames:
                traffic.on_coordinator(lambda f=frame, n=name: coordinator.handle(f.topic, f.payload, time.time()))
        traffic.on_coordinator(lambda: coordinator.tick(time.time() + 7200))
        assert coordinator.finished
    return traffic


def secure_round(devices: int, length: int, seed: int) -> tuple[Traffic, dict[str, Any]]:
    manifest, model, updates, dropped = fleet(devices, length, seed)
    names = sorted(updates)
    traffic = Traffic(names)
    with tempfile.TemporaryDirectory() as state:
        ids = identities(Path(state) / "identities", names)
        coordinator, announced = start(manifest, model, Path(state) / "coordinator", names, True, traffic,
                                       ids[names[0]] / ROOT_FILE)
        info = RoundInfo.decode(next(m.payload for m in announced if m.topic == TOPICS.round))
        session_id = int(info.secagg_session or 0)
        participants = {}
        for j, name in enumerate(names):
            meta = UpdateMeta(round=1, n_samples=100 + j, base_digest=manifest.base_digest, codec=SECAGG_CODEC)
            (Path(state) / name).mkdir()
            participants[name] = SecureParticipant(TOPICS, name, 1, session_id, manifest, updates[name], model,
                                                   100 + j, meta, 63 * 1024, ids[name], Path(state) / name,
                                                   info.sha256)
        queue = [m for name in names for m in traffic.on_device(name, lambda n=name: [participants[n].advertise()])]
        clock = time.time()
        while not coordinator.finished:
            while queue:
                message = queue.pop(0)
                kind, name = [*message.topic.split("/"), ""][3:5]  # round, state and model: for all, not counted
                if kind == "relay":
                    traffic.down[name] += len(message.payload)
                    decoded = decode_secagg(message.payload, SECAGG_DOWN)
                    replies = traffic.on_device(name, lambda n=name, d=decoded: participants[n].handle(d))
                    if name in dropped and decoded.stage == "shares":
                        continue  # gone after sharing its keys, before its share report
                    queue += replies
                elif kind in ("secagg", "update"):
                    queue += traffic.on_coordinator(
                        lambda m=message, c=clock: coordinator.handle(m.topic, m.payload, c))
                elif kind == "error":
                    raise AssertionError(f"the coordinator refused a message: {message.payload!r}")
            clock += 60.0  # past a stage's deadline (a dropped device's stage), within the round's
            queue += traffic.on_coordinator(lambda c=clock: coordinator.tick(c))
        setup = participants[names[0]].client
        assert setup is not None
    return traffic, {"degree": setup.config.degree, "threshold": setup.config.threshold}


def measure(devices: int, length: int, seed: int = 0) -> dict[str, Any]:
    plain = plain_round(devices, length, seed)
    secure, config = secure_round(devices, length, seed)
    contributors = [d for d in plain.up if plain.up[d]]
    return {"devices": devices, "length": length, **config, "dropped": devices - len(contributors),
            "plain_up_bytes": float(np.mean([plain.up[d] for d in contributors])),
            "plain_device_s": float(np.mean([plain.device_s[d] for d in contributors])),
            "plain_coordinator_s": plain.coordinator_s,
            "up_bytes": float(np.mean([secure.up[d] for d in contributors])),
            "down_bytes": float(np.mean([secure.down[d] for d in contributors])),
            "device_s": float(np.mean([secure.device_s[d] for d in contributors])),
            "coordinator_s": secure.coordinator_s}


def run(out: Path, quick: bool = False) -> str:
    devices, length = ((10, 20), 20_000) if quick else (DEVICES, LENGTH)
    rows = [measure(n, length) for n in devices]
    write_json(out, "secagg", {"rows": rows, "dropped_fraction": DROPPED})
    return table(["devices", "values", "k", "t", "dropped", "plain up KB", "secagg up KB", "up vs plain",
                  "secagg down KB", "plain device s", "secagg device s", "plain coordinator s",
                  "secagg coordinator s"],
                 [[r["devices"], f"{r['length']:,}", r["degree"], r["threshold"], r["dropped"],
                   r["plain_up_bytes"] / 1e3, r["up_bytes"] / 1e3, r["up_bytes"] / r["plain_up_bytes"],
                   r["down_bytes"] / 1e3, r["plain_device_s"], r["device_s"], r["plain_coordinator_s"],
                   r["coordinator_s"]] for r in rows])


if __name__ == "__main__":
    main(run, __doc__, quick="10 and 20 devices, 20,000 values")
