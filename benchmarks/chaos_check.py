"""The chaos soak's independent checker: reads only what the parties logged or published and proves the
invariants; prints every violation and exits non-zero on any.

    python benchmarks/chaos_check.py RUN_FOLDER [RUN_FOLDER ...]

Inputs: sent/*.safetensors (each scripted device's own copy of every update it sent),
agents/<name>/updates/r<k>.safetensors (each real agent's, `fedper-agent --keep-updates`: a safetensors file
whose metadata "json" holds round and n_samples), heads/*.safetensors and agents/<name>/device.safetensors
(each device's head, which must never leave it; an agent's: the tensors its metadata lists as "local"),
capture.bin (every message the broker delivered to a client subscribed to `#`), state/metrics.jsonl (the
coordinator's record of each round), soak.json (the state files that did not read after a kill),
export/manifest.json (which shared tensors are BatchNorm statistics, `trainable` false: the async and DP rules
treat them apart). It reads safetensors and JSON with those libraries and does its own float64 arithmetic; it
shares no code with the coordinator's aggregation (chunks are put together here).

Checks, per synchronous round k in metrics.jsonl: its participants are distinct (each update folded once),
each sent an update for round k (all its copies equal), n_samples is their sum, and the model released
after it (blob r{k+1}, or `final`, as captured) equals sum(n_j u_j) / sum(n_j) in float64 within float32
rounding (each n_j capped at the weight_cap the round records). Secure rounds (a "secagg" record):
r{k+1} = r{k} + sum(n_j clip_C(u_j - r{k})) / sum(n_j) within the quantization's error, C as soak.json
records it. Async versions and central DP rounds: see their functions.
Also: no captured payload holds a head tensor's name or its bytes; no state file unreadable;
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


Sent = dict[tuple[str, int], list[tuple[int, dict[str, np.ndarray]]]]


def _updates(r: dict[str, Any], sent: Sent, pairs: list[tuple[str, int]]
             ) -> tuple[list[str], list[int], list[dict[str, np.ndarray]] | None]:
    """Problems, and the n_samples and tensors of the listed (device, round) updates from the devices' copies
    (None when one is missing); a problem too when the record's n_samples is not their sum."""
    missing = [f"{d}@{k}" for d, k in pairs if (d, k) not in sent]
    if missing:
        return [f"round {r['round']}: updates listed that no device sent: {missing}"], [], None
    n = [sent[p][0][0] for p in pairs]
    problems = [] if sum(n) == r["n_samples"] else [
        f"round {r['round']}: n_samples {r['n_samples']} != {sum(n)}, the sum of its updates'"]
    return problems, n, [sent[p][0][1] for p in pairs]


def _released(k: int, expected: dict[str, np.ndarray], candidates: list[bytes], what: str,
              atol: float = ATOL) -> list[str]:
    if any(all(np.allclose(load(blob)[name], value, rtol=0, atol=atol) for name, value in expected.items())
           for blob in candidates):
        return []
    worst = max(float(np.max(np.abs(load(candidates[0])[name] - value))) for name, value in expected.items())
    return [f"round {k}: released model r{k + 1} is not {what} (max error {worst:.3g}, tolerance {atol:.3g})"]


def check_mean_round(r: dict[str, Any], sent: Sent, models: dict[str, list[bytes]], candidates: list[bytes],
                     folded_in: dict[str, int]) -> tuple[list[str], int]:
    """Synchronous round k: the model after it is sum(n_j u_j) / sum(n_j) over its participants."""
    k = r["round"]
    problems, n, updates = _updates(r, sent, [(d, k) for d in r["devices"]])
    if updates is None:
        return problems, 0
    if not candidates:
        return problems, 0  # released while the capture was away (a broker restart): not checkable, not a violation
    weights = [min(nj, r.get("weight_cap") or float("inf")) for nj in n]
    expected = {name: sum(w * u[name].astype(np.float64) for w, u in zip(weights, updates, strict=True)) / sum(weights)
                for name in updates[0]}
    return problems + _released(k, expected, candidates, f"the weighted mean of its {len(n)} updates"), 1


def check_version(r: dict[str, Any], sent: Sent, models: dict[str, list[bytes]], candidates: list[bytes],
                  folded_in: dict[str, int], statistics: frozenset[str]) -> tuple[list[str], int]:
    """Async version k (FedBuff, docs/protocol.md 8.2): r{k+1} = r{k} + sum(n_j w(s_j) (u_j - r{k_j})) / sum(n_j)
    with s_j = k - k_j and w(s) = 1 / sqrt(1 + s) (the soak's default staleness function); each update id
    (device@round) folded into one version only; staleness within max_staleness. `statistics` (BatchNorm running
    means and variances: estimates, not stepped) are the mean of the devices' values instead,
    sum(w(s_j) n_j u_j) / sum(w(s_j) n_j)."""
    k, buffer = r["round"], r["buffer"]
    problems = []
    pairs = []
    for update_id in buffer["updates"]:
        device, trained_on = update_id.rsplit("@", 1)
        pairs.append((device, int(trained_on)))
        if folded_in.setdefault(update_id, k) != k:
            problems.append(f"version {k}: update {update_id} folded again (first in version {folded_in[update_id]})")
    staleness = [k - kj for _, kj in pairs]
    if staleness != buffer["staleness"] or any(s < 0 or s > buffer["max_staleness"] for s in staleness):
        problems.append(f"version {k}: staleness {buffer['staleness']} recorded, {staleness} by the rounds named")
    more, n, updates = _updates(r, sent, pairs)
    problems += more
    if updates is None:
        return problems, 0
    cap = r.get("weight_cap", float("inf"))
    weights = [min(nj, cap) for nj in n]
    bases = [models.get(f"r{kj}", []) for _, kj in pairs] + [models.get(f"r{k}", [])]
    if not candidates or not all(bases):
        return problems, 0  # a model the capture missed (a broker restart): not checkable, not a violation
    model = {name: value.astype(np.float64) for name, value in load(bases[-1][0]).items()}
    step = {name: np.zeros_like(value) for name, value in model.items() if name not in statistics}
    values = {name: np.zeros_like(value) for name, value in model.items() if name in statistics}
    decayed = [w / np.sqrt(1.0 + s) for w, s in zip(weights, staleness, strict=True)]  # n_j w(s_j)
    for weight, u, base in zip(decayed, updates, bases, strict=False):
        start = load(base[0])
        for name in step:
            step[name] += weight * (u[name].astype(np.float64) - start[name].astype(np.float64))
        for name in values:
            values[name] += weight * u[name].astype(np.float64)
    expected = {name: model[name] + step[name] / sum(weights) for name in step} | {
        name: value / sum(decayed) for name, value in values.items()}
    return problems + _released(k, expected, candidates, f"r{k} plus the staleness-weighted mean of its "
                                                         f"{len(n)} deltas"), 1


def check_dp_round(r: dict[str, Any], sent: Sent, models: dict[str, list[bytes]], candidates: list[bytes],
                   folded_in: dict[str, int], statistics: frozenset[str]) -> tuple[list[str], int]:
    """Central DP round k: the mean before noise is not published, so what is checked is that the noise the
    coordinator recorded explains the release: residual = r{k+1} - r{k} - sum(clip_C(u_j - r{k})) / m must
    look like N(0, noise_std) (its std within 10 %, its mean within 6 standard errors), with C, noise_std and
    m as metrics.jsonl records them and noise_std = z C / m; and its projection on each participant's
    clipped delta within 6 noise_std (an update left out or folded twice moves it by C / m). All of it over the
    trainable tensors (clip_C's norm too): `statistics` (BatchNorm running means and variances) are neither
    clipped nor noised but released as r{k} holds them."""
    k, dp = r["round"], r["dp"]
    problems, _, updates = _updates(r, sent, [(d, k) for d in r["devices"]])
    if updates is None:
        return problems, 0
    c, std, m = dp["clip_norm"], dp["noise_std"], dp["expected_participants"]
    if not np.isclose(std, dp["noise_multiplier"] * c / m, rtol=1e-9):
        problems.append(f"round {k}: noise_std {std} recorded, z C / m = {dp['noise_multiplier'] * c / m}")
    start, released = models.get(f"r{k}", []), candidates
    if not start or not released:
        return problems, 0
    model = {name: value.astype(np.float64) for name, value in load(start[0]).items() if name not in statistics}
    kept = {name: value for name, value in load(start[0]).items() if name in statistics}
    clipped = []
    for u in updates:
        delta = {name: u[name].astype(np.float64) - model[name] for name in model}
        norm = np.sqrt(sum(float(np.sum(v * v)) for v in delta.values()))
        clipped.append({name: v * min(1.0, c / norm) for name, v in delta.items()})
    best: list[str] | None = None
    for blob in released:
        out = load(blob)
        residual = np.concatenate([(out[name].astype(np.float64) - model[name]
                                    - sum(d[name] for d in clipped) / m).ravel() for name in model])
        found = [f"round {k}: released r{k + 1} changed the statistics r{k} holds ({name})" for name in kept
                 if not np.array_equal(out[name], kept[name])]
        if not (0.9 * std <= residual.std() <= 1.1 * std) or abs(residual.mean()) > 6 * std / np.sqrt(residual.size):
            found.append(f"round {k}: released r{k + 1} minus r{k} and the clipped mean has std {residual.std():.4g}, "
                         f"mean {residual.mean():.3g}; noise_std {std:.4g} recorded")
        for device, d in zip(r["devices"], clipped, strict=True):
            direction = np.concatenate([d[name].ravel() for name in model])
            projection = float(residual @ direction) / float(np.linalg.norm(direction))
            if abs(projection) > 6 * std:
                found.append(f"round {k}: the noise leans {projection / std:.1f} noise_std along {device}'s clipped "
                             "delta (an update left out or folded twice?)")
        if not found:
            return problems, 1
        best = found if best is None or len(found) < len(best) else best
    return problems + (best or []), 1


def check_secure_round(r: dict[str, Any], sent: Sent, models: dict[str, list[bytes]], candidates: list[bytes],
                       folded_in: dict[str, int], clip: float) -> tuple[list[str], int]:
    """Secure round k (SecAgg+): the coordinator never sees an update, only the sum of the devices' clipped,
    n_j-scaled and quantized deltas, so r{k+1} = r{k} + sum(n_j clip_C(u_j - r{k})) / sum(n_j) over the listed
    devices (clip_C: scaled to L2 norm C at most over all shared tensors), within the quantization's error:
    each device rounds each value to a step of 2C / (2^b - 1), b = 32 - ceil(log2(devices in the session))."""
    k = r["round"]
    problems, n, updates = _updates(r, sent, [(d, k) for d in r["devices"]])
    if updates is None:
        return problems, 0
    start = models.get(f"r{k}", [])
    if not candidates or not start:
        return problems, 0
    model = {name: value.astype(np.float64) for name, value in load(start[0]).items()}
    expected = dict(model)
    if n:
        total = {name: np.zeros_like(value) for name, value in model.items()}
        for nj, u in zip(n, updates, strict=True):
            delta = {name: u[name].astype(np.float64) - model[name] for name in model}
            norm = np.sqrt(sum(float(np.sum(v * v)) for v in delta.values()))
            for name in model:
                total[name] += nj * min(1.0, clip / norm) * delta[name]
        expected = {name: model[name] + total[name] / sum(n) for name in model}
    bits = 32 - int(np.ceil(np.log2(max(2, r["secagg"].get("devices", 2)))))  # none: a round released unchanged
    step = 2 * clip / (2**bits - 1)
    tolerance = ATOL + len(n) * step / 2 * max(n, default=1) / max(sum(n), 1)  # rounding of the n_j / s-scaled sums
    return problems + _released(k, expected, candidates, f"r{k} plus the weighted mean of its {len(n)} clipped "
                                                         "deltas", tolerance), 1


def check(folder: Path) -> dict[str, Any]:
    """All violations in one run folder, and its figures."""
    violations: list[str] = []
    soak = json.loads((folder / "soak.json").read_text())
    violations += [f"state file unreadable after a kill: {p}" for p in soak["unreadable_state"]]
    violations += [f"liveness: {c}" for c in soak["crashes"]]
    sent: Sent = defaultdict(list)
    for path in (folder / "sent").glob("*.safetensors"):
        raw, meta = _read_with_metadata(path)
        sent[(meta["device"], int(meta["round"]))].append((int(meta["n_samples"]), load(raw)))
    heads = {path.stem: load_file(str(path)) for path in (folder / "heads").glob("*.safetensors")}
    for path in (folder / "agents").glob("*/updates/*.safetensors"):  # a real agent's --keep-updates copies
        raw, meta = _read_with_metadata(path)
        kept = json.loads(meta["json"])
        sent[(path.parent.parent.name, int(kept["round"]))].append((int(kept["n_samples"]), load(raw)))
    for path in (folder / "agents").glob("*/device.safetensors"):  # a real agent's checkpoint: its head in it
        raw, meta = _read_with_metadata(path)
        tensors = load(raw)
        heads[path.parent.name] = {name: tensors[name] for name in json.loads(meta["json"])["local"]}
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
    manifest = folder / "export" / "manifest.json"  # the export every party holds: which tensors are statistics
    statistics = frozenset(t["name"] for t in json.loads(manifest.read_text())["tensors"]
                           if t["shared"] and not t["trainable"]) if manifest.exists() else frozenset()
    by_round: dict[int, dict[str, Any]] = {}
    folded_in: dict[str, int] = {}  # async: update id (device@round) -> the version that folded it
    verified = 0
    for r in records:
        k, devices = r["round"], r["devices"]
        if k in by_round and sorted(by_round[k]["devices"]) != sorted(devices):
            violations.append(f"round {k} recorded twice with different participants")
        by_round[k] = r
        if len(set(devices)) != len(devices):
            violations.append(f"round {k}: an update folded twice: {devices}")
        candidates = models.get(f"r{k + 1}", []) + (models.get("final", []) if r is records[-1] else [])
        if "secagg" in r:
            problems, checked = check_secure_round(r, sent, models, candidates, folded_in, soak["clip_norm"])
        elif "buffer" in r or "dp" in r:
            rule = check_version if "buffer" in r else check_dp_round
            problems, checked = rule(r, sent, models, candidates, folded_in, statistics)
        else:
            problems, checked = check_mean_round(r, sent, models, candidates, folded_in)
        violations += problems
        verified += checked
    for topic, payload in messages:
        for device, tensors in heads.items():
            for name, value in tensors.items():
                if name.encode() in payload or value.tobytes()[:64] in payload:
                    violations.append(f"head tensor {name} of {device} on the wire ({topic})")
    return {"violations": violations, "rounds": len(by_round), "verified": verified,
            "seconds": soak["seconds"], "faults": soak["faults"],
            "updates_folded": sum(len(r["devices"]) for r in by_round.values())}


def _read_with_metadata(path: Path) -> tuple[bytes, dict[str, str]]:
    """A safetensors file's bytes and its string metadata (the header's __metadata__)."""
    raw = path.read_bytes()
    return raw, json.loads(raw[8:8 + struct.unpack_from("<Q", raw)[0]]).get("__metadata__", {})


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
