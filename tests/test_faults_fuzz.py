"""A seeded fuzzer against a live coordinator process through Mosquitto, for a bounded time.

It throws malformed, truncated, bit-flipped, oversized, NaN/Inf, wrong-shape, wrong-dtype,
wrong-digest, wrong-round, unregistered and replayed messages at the coordinator's topics while
round 1 is open (and replays in round 2), every frame built by hand (json, struct, zlib, hashlib and
safetensors' own writer), not with fedper.wire. Every one must be refused, answered and counted exactly
once, the process must keep serving, and the final model must be the good devices' weighted mean.
(test_coordinator_engine.py and test_untrusted_engine.py fuzz the engine in-process, the latter with frames
built by hand; test_coordinator_live.py sends one of each.)
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers.processes import Processes, coordinator_args, finish, saved_state
from helpers.recording import Recorder
from safetensors.numpy import save
from test_coordinator_live import (
    FLEET,
    TOPICS,
    Device,
    assert_model,
    expected_model,
    metrics,
    wait_for,
    write_artifacts,
)
from vectors.make_vectors import tiny_manifest, tiny_tensors

from fedper.manifest import Manifest
from fedper.payload import decode_shared

pytestmark = pytest.mark.mosquitto
FUZZ_SECONDS = 6.0
MAX_IN_FLIGHT = 200  # unanswered fuzz messages: stays under Mosquitto's per-client queue (1000)
EVIL = "fuzz"


def hand_frame(header: dict[str, object], body: bytes) -> bytes:
    """docs/protocol.md section 5, by hand: u32 header length, u32 crc32 of header + data, JSON header, data."""
    head = json.dumps({"v": 1, **header}, separators=(",", ":")).encode()
    return struct.pack(">II", len(head), zlib.crc32(head + body)) + head + body


def chunk_header(blob: bytes, chunk_size: int, blob_id: str, meta: dict[str, object], index: int = 0) -> dict:
    return {"blob_id": blob_id, "index": index, "count": max(1, -(-len(blob) // chunk_size)), "size": len(blob),
            "chunk_size": chunk_size, "sha256": hashlib.sha256(blob).hexdigest(), "meta": meta}


def hand_chunks(blob: bytes, chunk_size: int, blob_id: str, meta: dict[str, object]) -> list[bytes]:
    header = chunk_header(blob, chunk_size, blob_id, meta)
    return [hand_frame({**header, "index": i}, blob[i * chunk_size : (i + 1) * chunk_size])
            for i in range(header["count"])]


def fuzz_message(rng: np.random.Generator, i: int, manifest: Manifest, base: dict[str, np.ndarray],
                 replay: list[bytes]) -> tuple[str, str, bytes]:
    """(kind, topic, payload) of the i-th fuzz message: a fresh blob id each, so each is refused once."""
    digest = manifest.base_digest
    meta = {"round": 1, "n_samples": 5, "base_digest": digest}

    def frame(tensors: dict[str, np.ndarray] | bytes, **meta_changes: object) -> bytes:
        blob = tensors if isinstance(tensors, bytes) else save(tensors)
        [single] = hand_chunks(blob, 1 << 20, f"z{i}", {**meta, **meta_changes})
        return single

    valid = frame(base)
    update = TOPICS.update(EVIL)
    kind = str(rng.choice(["random", "truncated", "bitflip", "oversized", "huge", "nan", "inf", "shape", "dtype",
                           "extra", "missing", "digest", "round", "n_samples", "meta_type", "version", "no_field",
                           "nested", "unregistered", "register", "replay"],
                          p=[.08, .08, .08, .06, .01, .06, .05, .06, .05, .04, .04, .05, .05, .04, .04, .04, .04,
                             .03, .04, .05, .01]))
    name, values = next(iter(base.items()))
    if kind == "random":
        return kind, update, rng.bytes(int(rng.integers(0, 300)))
    if kind == "truncated":
        return kind, update, valid[: int(rng.integers(0, len(valid)))]
    if kind == "bitflip":
        flipped = bytearray(valid)
        flipped[int(rng.integers(0, len(valid)))] ^= 1 << int(rng.integers(0, 8))
        return kind, update, bytes(flipped)
    if kind == "oversized":  # a header that claims a gigabyte (and the counts to match)
        header = chunk_header(b"\x00" * 8, 4, f"z{i}", meta)
        return kind, update, hand_frame({**header, "size": 10**9, "count": 250_000_000}, b"\x00" * 4)
    if kind == "huge":  # a real 1 MiB chunk of a 2 MiB blob: above the coordinator's blob limit
        return kind, update, hand_chunks(rng.bytes(2 << 20), 1 << 20, f"z{i}", meta)[0]
    if kind in ("nan", "inf"):
        bad = values.copy()
        bad.flat[int(rng.integers(0, bad.size))] = np.nan if kind == "nan" else -np.inf
        return kind, update, frame({**base, name: bad})
    if kind == "shape":
        return kind, update, frame({**base, name: np.zeros(values.size + 1, values.dtype)})
    if kind == "dtype":
        return kind, update, frame({**base, name: values.astype(np.float64)})
    if kind == "extra":  # a device-local (head) tensor on the wire
        return kind, update, frame({**base, "classifier.weight": np.zeros((3, 2), np.float32)})
    if kind == "missing":
        return kind, update, frame({k: v for k, v in base.items() if k != name})
    if kind == "digest":
        return kind, update, frame(base, base_digest="sha256:" + rng.bytes(32).hex())
    if kind == "round":
        return kind, update, frame(base, round=int(rng.choice([0, 2, 7, -1, 2**40])))
    if kind == "n_samples":
        claims = [0, -3, "5", 1.5, None, True, 6, 10**12, 10**400]  # it registered 5: 6 and 10**12 are well-formed lies
        return kind, update, frame(base, n_samples=claims[int(rng.integers(0, len(claims)))])
    if kind == "meta_type":
        return kind, update, frame(base, metrics="fast") if rng.random() < 0.5 else frame(base, round="1")
    if kind in ("version", "no_field"):
        blob = save(base)
        header = chunk_header(blob, 1 << 20, f"z{i}", meta)
        header = {**header, "v": 2} if kind == "version" else {k: v for k, v in header.items() if k != "sha256"}
        return kind, update, hand_frame(header, blob)
    if kind == "nested":  # a JSON header nested deeper than any parser's recursion limit
        head = b"[" * 8000 + b"]" * 8000
        return kind, update, struct.pack(">II", len(head), zlib.crc32(head)) + head
    if kind == "unregistered":
        return kind, TOPICS.update(f"ghost{i}"), valid
    if kind == "register":
        bad = [b"{", b"[]", json.dumps({"v": 1, "n_samples": 0, "base_digest": digest, "software": "x"}).encode(),
               json.dumps({"v": 1, "n_samples": 5, "base_digest": "sha256:" + "0" * 64, "software": "x"}).encode(),
               json.dumps({"v": 2}).encode(),
               *(json.dumps({"v": 1, "n_samples": n, "base_digest": digest, "software": "x"}).encode()
                 for n in (10**400, 2_000_000))]  # beyond any float; above --max-samples-per-device
        return kind, TOPICS.register(f"reg{i}"), bad[int(rng.integers(0, len(bad)))]
    return kind, TOPICS.update("a"), replay[0]  # a's accepted round-1 update, again


def test_fuzzing_a_live_coordinator_changes_nothing(mosquitto, tmp_path: Path, processes: Processes) -> None:
    manifest, initial = tiny_manifest(), tiny_tensors()
    artifacts = write_artifacts(tmp_path / "export", manifest, initial)
    state = tmp_path / "state"
    # Every fuzz message must reach the validation it tests: the per-device rate limit and the update blobs a
    # device may start per round (their own tests are in test_untrusted_live.py and test_fleet_trust.py) are
    # raised above what the fuzzer sends on a fast machine.
    coordinator = processes.start("coordinator", *coordinator_args(artifacts, mosquitto.url, state, FLEET, 2, 2, 60,
                                                                   "--max-messages-per-second", "1000000",
                                                                   "--max-uploads-per-round", "1000000"))
    answers = Recorder(mosquitto.host, mosquitto.port, f"{TOPICS.base}/error/#")
    good = [Device(mosquitto.url, "a", 10, 1.0, manifest, respond=False),
            Device(mosquitto.url, "b", 30, -2.0, manifest, respond=False)]
    evil = Device(mosquitto.url, EVIL, 5, 100.0, manifest, respond=False)
    wait_for(lambda: len((saved_state(state) or {}).get("registered", {})) == 3 and "r1" in evil.blobs, 20,
             "registrations and round 1")
    base = decode_shared(manifest, evil.blobs["r1"])
    good[0].send(1, base)
    wait_for(lambda: "a" in saved_state(state)["round"]["folded"], 10, "a's round-1 update")
    a_meta = {"round": 1, "n_samples": 10, "base_digest": manifest.base_digest, "metrics": {"accuracy": 0.6}}
    replay = hand_chunks(save(good[0].update(base)), 1000, "r1-a", a_meta)
    assert len(replay) == 1

    rng = np.random.default_rng(20261122)
    sent: Counter[str] = Counter()
    counted = 0  # messages the coordinator must refuse and count (a replayed blob id is answered once)
    started = time.monotonic()
    while time.monotonic() - started < FUZZ_SECONDS:
        while counted - len(answers.messages) > MAX_IN_FLIGHT and time.monotonic() - started < FUZZ_SECONDS + 10:
            time.sleep(0.005)
        kind, topic, payload = fuzz_message(rng, sum(sent.values()), manifest, base, replay)
        evil.client.publish(topic, payload, qos=1)
        counted += kind != "replay" or sent["replay"] == 0
        sent[kind] += 1
    wait_for(lambda: len(answers.messages) >= counted, 30, f"{counted} answers")
    assert coordinator.poll() is None, processes.log("coordinator")

    evil.client.publish(TOPICS.register(EVIL), b"", qos=1, retain=True)  # it leaves: round 1 needs only a and b
    wait_for(lambda: EVIL not in saved_state(state)["registered"], 10, "the fuzzer to leave")
    good[1].send(1, base)
    wait_for(lambda: "r2" in evil.blobs, 10, "round 2")
    for frame in replay:  # round 1's update replayed in round 2
        good[0].client.publish(TOPICS.update("a"), frame, qos=1)
    counted += 1
    base2 = decode_shared(manifest, evil.blobs["r2"])
    for d in good:
        d.send(2, base2)
    assert finish(coordinator, 30, "the coordinator", processes.log("coordinator")) == 0
    answers.close()
    for d in [*good, evil]:
        d.close()

    final_state = json.loads((state / "state.json").read_text())
    counters = final_state["counters"]
    rejected = sum(v for k, v in counters.items() if k != "accepted")
    total = sum(sent.values())
    assert "internal_error" not in counters, counters
    assert rejected == counted == len(answers.messages), (rejected, counted, len(answers.messages), counters)
    assert counters["accepted"] == 4 and [r["participants"] for r in metrics(state)] == [2, 2]
    assert set(counters) >= {"bad_chunk", "bad_message", "bad_tensors", "digest_mismatch", "late_update",
                             "unknown_device", "duplicate_update", "n_samples_mismatch", "too_many_samples"}
    for d in good:
        d.respond = True
    assert_model(state / "final.safetensors", expected_model(initial, good, 2))
    print(f"fuzz: {total} messages in {FUZZ_SECONDS} s, {rejected} refused and counted: {dict(sent)}; "
          f"counters {counters}")
