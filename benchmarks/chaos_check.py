"""The chaos soak's independent checker: reads only what the parties logged or published and proves the
invariants; prints every violation and exits non-zero on any.

    python benchmarks/chaos_check.py RUN_FOLDER [RUN_FOLDER ...]

Inputs: sent/*.safetensors (each device's own copy of every update it sent), heads/*.safetensors (each
device's head, which must never leave it), capture.bin (every message the broker delivered to a client
subscribed to `#`), state/metrics.jsonl (the coordinator's record of each round), soak.json (the state
files that did not read after a kill). It reads safetensors and JSON with those libraries and does its own
float64 arithmetic; it shares no code with the coordinator's aggregation (chunks are put together here).

Checks, per synchronous round k in metrics.jsonl: its participants are distinct (each update folded once),
each sent an update for round k (all its copies equal), n_samples is their sum, and the model released
after it (blob r{k+1}, or `final`, as captured) equals sum(n_j u_j) / sum(n_j) in float64 within float32
rounding. Also: no captured payload holds a head tensor's name or its bytes; no state file unreadable;
a round recorded twice with different participants is a violation.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
import zlib
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load, load_file

ATOL = 1e-5  # the coordinator sums in float32


def read_capture(path: Path) -> list[tuple[str, bytes]]:
    data = path.read_bytes() if path.exists() else b""
    out, at = [], 0
    while at + 6 <= len(data):
        topic_len, size = struct.unpack_from("!HI", data, at)
        end = at + 6 + topic_len + size
        if end > len(data):
            break
        out.append((data[at + 6:at + 6 + topic_len].decode(), data[at + 6 + topic_len:end]))
        at = end
    return out


def split_chunk(payload: bytes) -> tuple[dict[str, Any], bytes]:
    """A chunk frame (docs/protocol.md): big-endian u32 header length and u32 crc32 of what follows, a JSON
    header, the data."""
    size, crc = struct.unpack_from("!II", payload)
    if zlib.crc32(payload[8:]) != crc:
        raise ValueError("crc32 mismatch")
    return json.loads(payload[8:8 + size]), payload[8 + size:]


def blobs(messages: list[tuple[str, bytes]], prefix: str) -> dict[str, bytes]:
    """Whole blobs (their sha256 checked) put together from the captured chunks on topics under `prefix`."""
    parts: dict[str, dict[int, bytes]] = defaultdict(dict)
    heads: dict[str, dict[str, Any]] = {}
    for topic, payload in messages:
        if not topic.startswith(prefix) or not payload:
            continue
        try:
            header, data = split_chunk(payload)
        except (ValueError, struct.error):
            continue
        key = f"{topic.rsplit('/', 2)[0] if '/model/' in topic else topic}|{header['blob_id']}|{header['sha256']}"
        heads[key] = header
        parts[key][header["index"]] = data
    out = {}
    for key, header in heads.items():
        if len(parts[key]) == header["count"]:
            blob = b"".join(parts[key][i] for i in range(header["count"]))
            if hashlib.sha256(blob).hexdigest() == header["sha256"]:
                out[key] = blob
    return out


def check(folder: Path) -> dict[str, Any]:
    """All violations in one run folder, and its figures."""
    violations: list[str] = []
    soak = json.loads((folder / "soak.json").read_text())
    violations += [f"state file unreadable after a kill: {p}" for p in soak["unreadable_state"]]
    violations += [f"liveness: {c}" for c in soak["crashes"]]
    sent: dict[tuple[str, int], list[tuple[int, dict[str, np.ndarray]]]] = defaultdict(list)
    for path in (folder / "sent").glob("*.safetensors"):
        with open(path, "rb") as f:
            raw = f.read()
        meta = json.loads(raw[8:8 + struct.unpack_from("<Q", raw)[0]])["__metadata__"]
        sent[(meta["device"], int(meta["round"]))].append((int(meta["n_samples"]), load(raw)))
    for (device, k), copies in sent.items():
        first = copies[0]
        if any(c[0] != first[0] or any(not np.array_equal(c[1][n], first[1][n]) for n in first[1]) for c in copies):
            violations.append(f"{device} sent different updates for round {k}")
    records = [json.loads(line) for line in (folder / "state" / "metrics.jsonl").read_text().splitlines()]
    messages = read_capture(folder / "capture.bin")
    base = "fedper/v1/chaos"  # docs/protocol.md: fedper/v1/<fleet>
    models: dict[str, list[bytes]] = defaultdict(list)
    for key, blob in blobs(messages, f"{base}/model/").items():
        models[key.split("|")[1]].append(blob)
    by_round: dict[int, dict[str, Any]] = {}
    verified = 0
    for r in records:
        k, devices = r["round"], r["devices"]
        if k in by_round and sorted(by_round[k]["devices"]) != sorted(devices):
            violations.append(f"round {k} recorded twice with different participants")
        by_round[k] = r
        if len(set(devices)) != len(devices):
            violations.append(f"round {k}: an update folded twice: {devices}")
        missing = [d for d in devices if (d, k) not in sent]
        if missing:
            violations.append(f"round {k}: participants with no update sent for it: {missing}")
            continue
        n = [sent[(d, k)][0][0] for d in devices]
        if sum(n) != r["n_samples"]:
            violations.append(f"round {k}: n_samples {r['n_samples']} != {sum(n)}, the sum of its participants'")
        updates = [sent[(d, k)][0][1] for d in devices]
        expected = {name: sum(nj * u[name].astype(np.float64) for nj, u in zip(n, updates, strict=True)) / sum(n)
                    for name in updates[0]}
        candidates = models.get(f"r{k + 1}", []) + (models.get("final", []) if r is records[-1] else [])
        if not candidates:
            continue  # released while the capture was away (a broker restart): not checkable, not a violation
        if not any(all(np.allclose(load(blob)[name], value, rtol=0, atol=ATOL) for name, value in expected.items())
                   for blob in candidates):
            worst = max(float(np.max(np.abs(load(candidates[0])[name] - value))) for name, value in expected.items())
            violations.append(f"round {k}: released model r{k + 1} is not the weighted mean of its "
                              f"{len(devices)} updates (max error {worst:.3g})")
        verified += 1
    heads = {path.stem: load_file(str(path)) for path in (folder / "heads").glob("*.safetensors")}
    for topic, payload in messages:
        for device, tensors in heads.items():
            for name, value in tensors.items():
                if name.encode() in payload or value.tobytes()[:64] in payload:
                    violations.append(f"head tensor {name} of {device} on the wire ({topic})")
    return {"violations": violations, "rounds": len(by_round), "verified": verified,
            "seconds": soak["seconds"], "faults": soak["faults"],
            "updates_folded": sum(len(r["devices"]) for r in by_round.values())}


def summary(mode: str, faults: dict[str, Any], calm: dict[str, Any]) -> str:
    per_min = {name: r["rounds"] / (r["seconds"] / 60) for name, r in (("faults", faults), ("calm", calm))}
    lines = [f"{mode}: {faults['seconds'] / 60:.1f} min; faults {faults['faults']}; rounds released "
             f"{faults['rounds']} ({faults['verified']} models checked) under faults, {calm['rounds']} without; "
             f"{per_min['faults']:.1f} vs {per_min['calm']:.1f} rounds/min; "
             f"violations {len(faults['violations'])} (faults) + {len(calm['violations'])} (calm)"]
    lines += [f"  VIOLATION: {v}" for v in faults["violations"] + calm["violations"]]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        raise SystemExit(__doc__)
    bad = 0
    for folder in map(Path, sys.argv[1:]):
        result = check(folder)
        print(f"{folder}: {result['rounds']} rounds, {result['verified']} models checked, "
              f"{len(result['violations'])} violations")
        for v in result["violations"]:
            print(f"  VIOLATION: {v}")
        bad += len(result["violations"])
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
