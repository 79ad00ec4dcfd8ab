"""Writes the protocol v1 test vectors (docs/protocol.md) next to this file.

`manifest.json` is the toy model the blobs follow. Each vector is `<name>.bin` (an MQTT payload,
byte for byte) and `<name>.expected.json` (what a correct decoder makes of it, or the error code it
must refuse it with). A phone app checks its
decoder against them; tests/test_wire_vectors.py checks ours, and that this script reproduces them.

    python tests/vectors/make_vectors.py [OUT_DIR]
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from fedper.manifest import Manifest, ModelInfo, TensorSpec
from fedper.payload import encode_shared
from fedper.wire import (
    ErrorMessage,
    Invitation,
    Register,
    RoundInfo,
    SecAggMask,
    SecAggReceived,
    SecAggShares,
    SecAggSignature,
    SecAggSurvivors,
    SecAggUnmask,
    SecAggUnmaskRequest,
    Topics,
    UpdateMeta,
    chunk,
    decode_frame,
)

FLEET, DEVICE = "demo", "phone-1"
CHUNK_SIZE = 64  # tiny on purpose: the blobs below span several chunks


def tiny_manifest() -> Manifest:
    """Two base tensors (shared) and one head tensor (device-local) of a toy FedPer model."""
    spec = [
        ("stem.weight", (2, 3), "float32", "base", True),
        ("stem.bias", (2,), "float32", "base", True),
        ("classifier.weight", (3, 2), "float32", "head", True),
    ]
    info = ModelInfo("tiny", kp=1, num_classes=3, input_shape=(3, 1, 1), mean=(0.0,) * 3, std=(1.0,) * 3)
    tensors = tuple(TensorSpec(n, s, d, r, t, shared=r == "base") for n, s, d, r, t in spec)
    return Manifest(model=info, algorithm="fedper", tensors=tensors)


def tiny_tensors(offset: float = 0.0) -> dict[str, np.ndarray]:
    return {
        "stem.weight": (np.arange(6, dtype=np.float32).reshape(2, 3) / 4 + offset).astype(np.float32),
        "stem.bias": np.array([0.5, -1.25], dtype=np.float32) + np.float32(offset),
    }


def _values(blob_tensors: dict[str, np.ndarray]) -> dict[str, dict]:
    return {n: {"dtype": str(a.dtype), "shape": list(a.shape), "values": a.ravel().tolist()}
            for n, a in blob_tensors.items()}


def vectors() -> dict[str, tuple[bytes, dict]]:
    """name -> (payload, expected)."""
    manifest = tiny_manifest()
    topics = Topics(FLEET)
    digest = manifest.base_digest
    out: dict[str, tuple[bytes, dict]] = {}

    def message(name: str, topic: str, msg) -> None:  # type: ignore[no-untyped-def]
        payload = msg.encode()
        out[name] = (payload, {"topic": topic, "kind": type(msg).__name__, "message": json.loads(payload)})

    register = Register(n_samples=120, base_digest=digest, software="fedper-agent/0.1.0")
    message("register", topics.register(DEVICE), register)
    blob = encode_shared(manifest, tiny_tensors())
    frames = chunk(blob, CHUNK_SIZE, "r1", {"round": 1})
    message("round", topics.round, RoundInfo(
        round=1, rounds=3, state="open", deadline=1767225600.0, blob_id="r1", size=len(blob),
        sha256=hashlib.sha256(blob).hexdigest(), count=len(frames), base_digest=digest))
    message("error", topics.error(DEVICE), ErrorMessage("late_update", "update for round 1, but round 2 is open", 2))

    def blob_vectors(name: str, topic_of, frames: list[bytes], blob_tensors: dict[str, np.ndarray]) -> None:  # type: ignore[no-untyped-def]
        whole = b""
        for i, frame in enumerate(frames):
            header, data = decode_frame(frame)
            whole += data
            expected = {"topic": topic_of(i), "kind": "chunk", "header": header, "data_hex": data.hex()}
            out[f"{name}.{i}"] = (frame, expected)
        out[name] = (whole, {"kind": "blob", "sha256": hashlib.sha256(whole).hexdigest(), "size": len(whole),
                             "chunks": [f"{name}.{i}.bin" for i in range(len(frames))],
                             "tensors": _values(blob_tensors)})

    blob_vectors("model-r1", lambda i: topics.model("r1", i), frames, tiny_tensors())
    meta = UpdateMeta(round=1, n_samples=120, base_digest=digest, metrics={"accuracy": 0.75, "loss": 0.5})
    update = chunk(encode_shared(manifest, tiny_tensors(0.125)), CHUNK_SIZE, "r1-0a1b2c3d", meta.to_dict())
    blob_vectors("update-r1", lambda i: topics.update(DEVICE), update, tiny_tensors(0.125))

    corrupt = bytearray(update[0])
    corrupt[-1] ^= 0xFF
    why = "the last data byte flipped: crc32 mismatch"
    out["bad-corrupt-chunk"] = (bytes(corrupt), {"kind": "chunk", "error": "bad_chunk", "why": why})
    out["bad-truncated-chunk"] = (update[0][:-3], {"kind": "chunk", "error": "bad_chunk", "why": "data too short"})
    out["bad-short-frame"] = (update[0][:20], {"kind": "chunk", "error": "bad_chunk", "why": "header cut off"})
    out["bad-version"] = (b'{"v":2,"n_samples":1,"base_digest":"x","software":"y"}',
                          {"kind": "Register", "error": "bad_message", "why": "unsupported protocol version"})
    empty = chunk(b"", CHUNK_SIZE, "empty")[0]
    out["empty-blob.0"] = (empty, {"kind": "chunk", "header": decode_frame(empty)[0], "data_hex": ""})
    out.update(async_vectors(topics, manifest))
    out.update(secagg_vectors(topics))
    return out


def async_vectors(topics: Topics, manifest: Manifest) -> dict[str, tuple[bytes, dict]]:
    """Asynchronous rounds (docs/protocol.md, 8.2): RoundInfo of version 3 taking updates trained on rounds 1-3,
    an invitation (still naming round 2 after round 3 opened), the first chunk of an update trained on round 2,
    and the answer to one trained on a round out of the window."""
    blob = encode_shared(manifest, tiny_tensors(0.5))
    frames = chunk(blob, CHUNK_SIZE, "r3", {"round": 3})
    info = RoundInfo(round=3, rounds=10, state="open", deadline=1767225600.0, blob_id="r3", size=len(blob),
                     sha256=hashlib.sha256(blob).hexdigest(), count=len(frames), base_digest=manifest.base_digest,
                     selection="invited", next_selection_at=1767225600.0, max_staleness=2)
    meta = UpdateMeta(round=2, n_samples=120, base_digest=manifest.base_digest, metrics={"accuracy": 0.5})
    stale = chunk(encode_shared(manifest, tiny_tensors(0.25)), CHUNK_SIZE, "r2-5e6f7a8b", meta.to_dict())[0]
    header, data = decode_frame(stale)
    error = ErrorMessage("stale_update", "update trained on round 1's model, more than --max-staleness 1 versions "
                         "before the open round 3", 3)
    training = replace(info, selection="all", next_selection_at=None, max_staleness=None, lr=0.025, local_epochs=3,
                       batch_size=64)  # the coordinator decides the round's training (--lr, --local-epochs ...)
    messages = {"round-async": (topics.round, info), "round-training": (topics.round, training),
                "invite": (topics.invite(DEVICE), Invitation(2)),
                "error-stale": (topics.error(DEVICE), error)}
    out = {name: (msg.encode(), {"topic": topic, "kind": type(msg).__name__, "message": json.loads(msg.encode())})
           for name, (topic, msg) in messages.items()}
    out["update-stale.0"] = (stale, {"topic": topics.update(DEVICE), "kind": "chunk", "header": header,
                                     "data_hex": data.hex()})
    return out


def _fixed(label: str, size: int = 32) -> bytes:
    """Deterministic bytes for a vector's keys and payloads (SHA-256 of the label, repeated)."""
    return (hashlib.sha256(label.encode()).digest() * (size // 32 + 1))[:size]


def secagg_vectors(topics: Topics) -> dict[str, tuple[bytes, dict]]:
    """Secure aggregation's stage messages (docs/protocol.md, 6.9), one of each kind and direction. Keys come from
    fixed seeds, so the advert's certificate and signature and the survivor signature are real: `root` is the
    fleet root's public key (base64) they verify with, `setup_digest` the digest the survivor signature covers."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from fedper.secagg import (
        Certificate,
        DeviceKeys,
        Identity,
        SecAggConfig,
        SecAggServer,
        certificate_message,
        survivors_message,
    )

    root = Ed25519PrivateKey.from_private_bytes(_fixed("fleet root"))
    roster = (DEVICE, "phone-2", "phone-3")
    identities = {}
    for name in roster:
        key = Ed25519PrivateKey.from_private_bytes(_fixed(f"identity {name}"))
        public = key.public_key().public_bytes_raw()
        certificate = Certificate(FLEET, name, public, root.sign(certificate_message(FLEET, name, public)))
        identities[name] = Identity(key, certificate, root.public_key())
    keys = {name: DeviceKeys(X25519PrivateKey.from_private_bytes(_fixed(f"c {name}")),
                             X25519PrivateKey.from_private_bytes(_fixed(f"s {name}"))) for name in roster}
    session = 4242
    config = SecAggConfig.create(1, session, roster, length=5, clip=0.5, graph_seed=7)
    adverts = {i: keys[name].advert(identities[name], 1, session) for i, name in enumerate(roster)}
    setups = SecAggServer(config, FLEET, root.public_key()).neighbour_keys(adverts, weight_scale=120)
    sealed = _fixed("sealed share", 168)
    signatures = [identities[name].sign(survivors_message(config.digest, (0, 1, 2))) for name in roster[:2]]
    signers = {i: adverts[i].identity + adverts[i].certificate + signatures[i] for i in range(2)}
    extra = {"root": base64.b64encode(root.public_key().public_bytes_raw()).decode(),
             "setup_digest": config.digest.hex()}
    messages = {
        "secagg-advertise": (topics.secagg(DEVICE), adverts[0]),
        "secagg-neighbours": (topics.relay(DEVICE), setups[0]),
        "secagg-shares-up": (topics.secagg(DEVICE), SecAggShares(1, session, {1: sealed, 2: sealed})),
        "secagg-received": (topics.secagg(DEVICE), SecAggReceived(1, session, [2])),
        "secagg-mask": (topics.relay(DEVICE), SecAggMask(1, session, [])),
        "secagg-consistency-down": (topics.relay(DEVICE), SecAggSurvivors(1, session, [0, 1, 2])),
        "secagg-consistency-up": (topics.secagg(DEVICE), SecAggSignature(1, session, signatures[0])),
        "secagg-unmask-down": (topics.relay(DEVICE), SecAggUnmaskRequest(1, session, signers)),
        "secagg-unmask-up": (topics.secagg(DEVICE), SecAggUnmask(
            1, session, {1: _fixed("seed share of 1", 66)}, {2: _fixed("key share of 2", 66)})),
    }
    return {name: (msg.encode(), {"topic": topic, "kind": type(msg).__name__, "message": json.loads(msg.encode()),
                                  **extra})
            for name, (topic, msg) in messages.items()}


def write(directory: Path) -> None:
    tiny_manifest().save(directory)  # manifest.json: the layout behind base_digest and the blobs
    for name, (payload, expected) in vectors().items():
        (directory / f"{name}.bin").write_bytes(payload)
        (directory / f"{name}.expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent)
