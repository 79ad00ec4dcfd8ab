"""The chaos soak's checker (benchmarks/chaos_check.py) finds doctored runs, and the soak's quick form
(async scripted only, then sync with its 2 agents: 15 s calm and 30 s under faults each) passes it."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save, save_file

from fedper.checkpoint import write_checkpoint

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import chaos_check  # noqa: E402 (benchmarks/ is not a package: imported from its folder)

BASE = "fedper/v1/chaos"
DEVICES = {"dev-000": 1, "dev-001": 2, "dev-002": 3}  # name -> n_samples


def frame(blob_id: str, blob: bytes, index: int, count: int, size: int) -> bytes:
    """A chunk frame built by hand after docs/protocol.md (u32 header length, u32 crc32, JSON header, body)."""
    part = blob[index * size:(index + 1) * size]
    head = json.dumps({"v": 1, "blob_id": blob_id, "index": index, "count": count, "size": len(blob),
                       "chunk_size": size, "sha256": hashlib.sha256(blob).hexdigest(), "meta": {}}).encode()
    return struct.pack(">II", len(head), zlib.crc32(part, zlib.crc32(head))) + head + part


def record(topic: str, payload: bytes) -> bytes:
    return struct.pack("!HI", len(topic), len(payload)) + topic.encode() + payload


def make_run(folder: Path, *, leave_out: str | None = None, n_samples_extra: int = 0,
             leak_head: bool = False) -> None:
    """A run folder as the soak leaves it: three devices' updates for round 1, the model r2 released after it
    (the float64 weighted mean, or leaving out one device's update), metrics.jsonl, the capture."""
    for sub in ("sent", "heads", "state"):
        (folder / sub).mkdir(parents=True)
    rng = np.random.default_rng(0)
    updates = {d: {"base.w": rng.normal(size=(4, 8)).astype(np.float32)} for d in DEVICES}
    heads = {d: {"head.weight": rng.normal(size=(3, 8)).astype(np.float32)} for d in DEVICES}
    for d, n in DEVICES.items():
        save_file(updates[d], str(folder / "sent" / f"{d}-r1-1.safetensors"),
                  metadata={"n_samples": str(n), "round": "1", "device": d})
        save_file(heads[d], str(folder / "heads" / f"{d}.safetensors"))
    folded = [d for d in DEVICES if d != leave_out]
    mean = sum(DEVICES[d] * updates[d]["base.w"].astype(np.float64) for d in folded) / sum(DEVICES[d] for d in folded)
    model = save({"base.w": mean.astype(np.float32)})
    capture = b"".join(record(f"{BASE}/model/r2/{i}", frame("r2", model, i, 2, len(model) // 2 + 1))
                       for i in range(2))
    if leak_head:
        capture += record(f"{BASE}/update/dev-001", save(heads["dev-001"]))
    (folder / "capture.bin").write_bytes(capture)
    metrics = {"round": 1, "devices": list(DEVICES), "n_samples": sum(DEVICES.values()) + n_samples_extra}
    (folder / "state" / "metrics.jsonl").write_text(json.dumps(metrics) + "\n")
    (folder / "soak.json").write_text(json.dumps({"seconds": 60, "faults": {}, "unreadable_state": [],
                                                  "crashes": []}))


def test_checker_passes_an_honest_run(tmp_path: Path) -> None:
    make_run(tmp_path)
    result = chaos_check.check(tmp_path)
    assert result["violations"] == [] and result["verified"] == 1


def test_checker_finds_a_model_off_by_one_update(tmp_path: Path) -> None:
    make_run(tmp_path, leave_out="dev-002")
    assert any("not the weighted mean" in v for v in chaos_check.check(tmp_path)["violations"])


def test_checker_finds_a_doctored_metrics_line(tmp_path: Path) -> None:
    make_run(tmp_path, n_samples_extra=1)
    assert any("n_samples" in v for v in chaos_check.check(tmp_path)["violations"])


def test_checker_finds_a_head_on_the_wire(tmp_path: Path) -> None:
    make_run(tmp_path, leak_head=True)
    assert any("head tensor head.weight of dev-001" in v for v in chaos_check.check(tmp_path)["violations"])


def test_checker_command_exits_non_zero_on_a_violation(tmp_path: Path) -> None:
    make_run(tmp_path, leave_out="dev-000")
    done = subprocess.run([sys.executable, str(BENCH / "chaos_check.py"), str(tmp_path)], capture_output=True,
                          text=True)
    assert done.returncode == 1 and "VIOLATION" in done.stdout


def write_run(folder: Path, sent: list[tuple[str, int, int, dict[str, np.ndarray]]],
              models: dict[str, dict[str, np.ndarray]], metrics: list[dict[str, object]]) -> None:
    """A run folder from its parts: the devices' copies (device, round, n_samples, tensors: a real agent's, named
    agent-*, as `fedper-agent --keep-updates` writes it, by the agent's own writer), the released models by blob id
    (captured as hand-built chunk frames) and metrics.jsonl's lines."""
    for sub in ("sent", "heads", "state"):
        (folder / sub).mkdir(parents=True)
    for i, (device, round_, n, tensors) in enumerate(sent):
        if device.startswith("agent-"):
            (folder / "agents" / device / "updates").mkdir(parents=True, exist_ok=True)
            write_checkpoint(folder / "agents" / device / "updates" / f"r{round_}.safetensors", tensors,
                             {"round": round_, "base_digest": "sha256:x", "n_samples": n})
            continue
        save_file(tensors, str(folder / "sent" / f"{device}-r{round_}-{i}.safetensors"),
                  metadata={"n_samples": str(n), "round": str(round_), "device": device})
    capture = b""
    for blob_id, tensors in models.items():
        blob = save({name: value.astype(np.float32) for name, value in tensors.items()})
        capture += b"".join(record(f"{BASE}/model/{blob_id}/{i}", frame(blob_id, blob, i, 2, len(blob) // 2 + 1))
                            for i in range(2))
    (folder / "capture.bin").write_bytes(capture)
    (folder / "state" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (folder / "soak.json").write_text(json.dumps({"seconds": 60, "faults": {}, "unreadable_state": [],
                                                  "crashes": []}))


@pytest.mark.parametrize("recorded_cap", [2, None])
def test_checker_weighs_a_sync_round_with_the_recorded_weight_cap(tmp_path: Path, recorded_cap: int | None) -> None:
    """--max-weight-ratio: the round's mean weighs dev-002 (n = 3) at the cap of 2 the metrics line records; the
    same release without the cap recorded is not the mean."""
    rng = np.random.default_rng(4)
    updates = {d: rng.normal(size=(4, 8)).astype(np.float32) for d in DEVICES}
    weights = {d: min(n, 2) for d, n in DEVICES.items()}
    mean = sum(weights[d] * updates[d].astype(np.float64) for d in DEVICES) / sum(weights.values())
    line = {"round": 1, "devices": list(DEVICES), "n_samples": 6, **({"weight_cap": recorded_cap} if recorded_cap
                                                                      else {})}
    write_run(tmp_path, [(d, 1, n, {"base.w": updates[d]}) for d, n in DEVICES.items()], {"r2": {"base.w": mean}},
              [line])
    violations = chaos_check.check(tmp_path)["violations"]
    assert (violations == []) == (recorded_cap is not None), violations


def make_versions(folder: Path, *, unweighted: bool = False, fold_twice: bool = False, stale: str = "dev-000",
                  statistics: str | None = None) -> None:
    """Async: version 1 folds dev-002's update (r2 itself); version 2 folds `stale`'s update trained on r1
    (staleness 1: dev-000, or a real agent's --keep-updates copy) and dev-001's on r2 (staleness 0);
    r3 = r2 + (n_0 Δ_0 / sqrt(2) + n_1 Δ_1) / (n_0 + n_1), worked out here term by term in float64.
    `statistics`: the models also hold a BatchNorm variance, bn.var (the export's manifest says so), released
    as the mean of the devices' values weighted w(s_j) n_j ("mean", as fedper.buffered does) or stepped as a
    parameter ("stepped")."""
    rng = np.random.default_rng(1)
    r1 = {"base.w": rng.normal(size=(4, 8))}
    r2 = {"base.w": rng.normal(size=(4, 8)).astype(np.float32)}  # dev-002's update on r1, weight 1: r2 itself
    u0, u1 = rng.normal(size=(4, 8)).astype(np.float32), rng.normal(size=(4, 8)).astype(np.float32)
    d0 = u0.astype(np.float64) - r1["base.w"].astype(np.float32)
    d1 = u1.astype(np.float64) - r2["base.w"].astype(np.float32)
    w0 = 1.0 if unweighted else 1 / np.sqrt(2.0)
    r3 = {"base.w": r2["base.w"].astype(np.float32) + (1 * w0 * d0 + 2 * d1) / 3}
    buffer = {"version": 3, "updates": [f"{stale}@1", "dev-001@2"], "staleness": [1, 0], "max_staleness": 4}
    metrics = [{"round": 1, "devices": ["dev-002"], "n_samples": 3,
                "buffer": {**buffer, "version": 2, "updates": ["dev-002@1"], "staleness": [0]}},
               {"round": 2, "devices": [stale, "dev-001"], "n_samples": 3, "buffer": buffer}]
    if fold_twice:
        metrics[0] = {**metrics[0], "devices": [stale], "n_samples": 1,
                      "buffer": {**metrics[0]["buffer"], "updates": [f"{stale}@1"]}}
    sent = [(stale, 1, 1, {"base.w": u0}), ("dev-001", 2, 2, {"base.w": u1}),
            ("dev-002", 1, 3, r2)]
    if statistics:
        var_rng = np.random.default_rng(9)
        v = {key: var_rng.uniform(0.5, 2.0, size=4).astype(np.float32) for key in ("r1", "r2", "u0", "u1")}
        if statistics == "mean":
            r3_var = (w0 * 1 * v["u0"].astype(np.float64) + 1 * 2 * v["u1"]) / (w0 * 1 + 1 * 2)
        else:
            r3_var = v["r2"] + (w0 * 1 * (v["u0"].astype(np.float64) - v["r1"]) + 2 * (v["u1"] - v["r2"])) / 3
        r1, r2, r3 = r1 | {"bn.var": v["r1"]}, r2 | {"bn.var": v["r2"]}, r3 | {"bn.var": r3_var}
        sent = [(stale, 1, 1, {"base.w": u0, "bn.var": v["u0"]}), ("dev-001", 2, 2, {"base.w": u1, "bn.var": v["u1"]}),
                ("dev-002", 1, 3, r2)]
    write_run(folder, sent, {"r1": r1, "r2": r2, "r3": r3}, metrics)
    if statistics:
        write_manifest(folder)


def write_manifest(folder: Path) -> None:
    """The run's export/manifest.json (the fields the checker reads): base.w a weight, bn.var a BatchNorm statistic
    (shared, not trainable), head.w the head."""
    (folder / "export").mkdir()
    (folder / "export" / "manifest.json").write_text(json.dumps({"tensors": [
        {"name": "base.w", "shared": True, "trainable": True},
        {"name": "bn.var", "shared": True, "trainable": False},
        {"name": "head.w", "shared": False, "trainable": True}]}))


@pytest.mark.parametrize("statistics", ["mean", "stepped"])
def test_checker_takes_async_batchnorm_statistics_as_the_mean_of_the_devices_values(tmp_path: Path,
                                                                                     statistics: str) -> None:
    """fedper.buffered does not step BatchNorm statistics (a stale variance delta can make one negative): r3's
    bn.var is sum(w(s_j) n_j v_j) / sum(w(s_j) n_j); the same version with bn.var stepped like a weight is not."""
    make_versions(tmp_path, statistics=statistics, stale="agent-0")
    violations = chaos_check.check(tmp_path)["violations"]
    assert (violations == []) == (statistics == "mean"), violations


@pytest.mark.parametrize("stale", ["dev-000", "agent-0"])
def test_checker_passes_honest_async_versions(tmp_path: Path, stale: str) -> None:
    make_versions(tmp_path, stale=stale)
    result = chaos_check.check(tmp_path)
    assert result["violations"] == [] and result["verified"] == 2


@pytest.mark.parametrize("stale", ["dev-000", "agent-0"])
def test_checker_finds_a_version_without_staleness_weights(tmp_path: Path, stale: str) -> None:
    """Also when the stale update is a real agent's (its copy under agents/agent-0/updates/r1.safetensors)."""
    make_versions(tmp_path, unweighted=True, stale=stale)
    assert any("round 2: released model r3" in v for v in chaos_check.check(tmp_path)["violations"])


@pytest.mark.parametrize("stale", ["dev-000", "agent-0"])
def test_checker_finds_an_update_folded_into_two_versions(tmp_path: Path, stale: str) -> None:
    make_versions(tmp_path, fold_twice=True, stale=stale)
    assert any(f"{stale}@1 folded again" in v for v in chaos_check.check(tmp_path)["violations"])


def make_dp_round(folder: Path, *, leave_out: str | None = None, std_recorded: float | None = None,
                  agent: str = "dev-002", statistics: str | None = None) -> None:
    """Central DP, round 1 of m = 3 expected: r2 = r1 + (sum of the deltas clipped to C + N(0, (z C)^2)) / m;
    `agent`: the third device (dev-002, or a real agent with its --keep-updates copy); `leave_out`: a device whose
    update the release misses; `statistics`: the models also hold a BatchNorm variance, bn.var, which r2 keeps as
    r1 holds it ("kept", as fedper.privacy's DP-FedAvg does) or takes as the devices' mean ("averaged")."""
    rng = np.random.default_rng(2)
    shape, c, z, m = (64, 64), 5.0, 0.1, 3.0
    r1 = {"base.w": rng.normal(size=shape).astype(np.float32)}
    devices = {**{d: n for d, n in DEVICES.items() if d != "dev-002"}, agent: DEVICES["dev-002"]}
    updates = {d: rng.normal(size=shape).astype(np.float32) for d in devices}
    total = np.zeros(shape)
    for d, u in updates.items():
        if d == leave_out:
            continue
        delta = u.astype(np.float64) - r1["base.w"]
        total += delta * min(1.0, c / np.linalg.norm(delta))
    r2 = {"base.w": r1["base.w"] + (total + rng.normal(0.0, z * c, shape)) / m}
    dp = {"clip_norm": c, "noise_multiplier": z, "noise_std": std_recorded or z * c / m, "expected_participants": m}
    metrics = [{"round": 1, "devices": list(devices), "n_samples": 6, "dp": dp}]
    sent = [(d, 1, n, {"base.w": updates[d]}) for d, n in devices.items()]
    if statistics:
        var = {d: rng.uniform(0.5, 2.0, size=8).astype(np.float32) for d in ("r1", *devices)}
        r1["bn.var"] = var["r1"]
        r2["bn.var"] = var["r1"] if statistics == "kept" else np.mean([var[d] for d in devices], axis=0)
        sent = [(d, k, n, {**tensors, "bn.var": var[d]}) for d, k, n, tensors in sent]
    write_run(folder, sent, {"r1": r1, "r2": r2}, metrics)
    if statistics:
        write_manifest(folder)


@pytest.mark.parametrize("agent", ["dev-002", "agent-0"])
def test_checker_passes_an_honest_dp_round(tmp_path: Path, agent: str) -> None:
    make_dp_round(tmp_path, agent=agent)
    result = chaos_check.check(tmp_path)
    assert result["violations"] == [] and result["verified"] == 1


@pytest.mark.parametrize("agent", ["dev-002", "agent-0"])
def test_checker_finds_a_dp_round_without_one_update(tmp_path: Path, agent: str) -> None:
    make_dp_round(tmp_path, leave_out=agent, agent=agent)
    assert any("leans" in v and agent in v for v in chaos_check.check(tmp_path)["violations"])


@pytest.mark.parametrize("statistics", ["kept", "averaged"])
def test_checker_wants_dp_to_release_batchnorm_statistics_unchanged(tmp_path: Path, statistics: str) -> None:
    """Under DP the statistics are neither clipped nor noised (not gradients: fedper.privacy) but kept as r1 has
    them; a release that averaged the devices' values is reported."""
    make_dp_round(tmp_path, agent="agent-0", statistics=statistics)
    violations = chaos_check.check(tmp_path)["violations"]
    assert (violations == []) == (statistics == "kept"), violations
    assert all("changed the statistics r1 holds (bn.var)" in v for v in violations)


def test_checker_finds_dp_noise_other_than_recorded(tmp_path: Path) -> None:
    make_dp_round(tmp_path, std_recorded=2 * 0.1 * 5.0 / 3)
    assert any("noise_std" in v for v in chaos_check.check(tmp_path)["violations"])


def make_secure_round(folder: Path, *, leave_out: bool = False, unclipped: bool = False,
                      leak_head: bool = False) -> None:
    """Secure aggregation, round 1 of three real agents (their --keep-updates copies and checkpoints written by the
    agent's own writer): r2 = r1 + sum(n_j clip_C(u_j - r1)) / sum(n_j), agent-2's delta beyond C; or that
    mean without agent-2's update, or without the clipping."""
    rng = np.random.default_rng(3)
    shape, c = (16, 16), 20.0
    agents = {"agent-0": 16, "agent-1": 12, "agent-2": 8}
    r1 = {"base.w": rng.normal(size=shape).astype(np.float32)}
    scales = {"agent-0": 0.5, "agent-1": 1.0, "agent-2": 4.0}  # delta norms about 8, 16 and 64 (> C: clipped)
    updates = {a: (r1["base.w"] + scales[a] * rng.normal(size=shape)).astype(np.float32) for a in agents}
    total, weight = np.zeros(shape), 0
    for a, n in agents.items():
        if leave_out and a == "agent-2":
            continue
        delta = updates[a].astype(np.float64) - r1["base.w"]
        total += n * delta * (1.0 if unclipped else min(1.0, c / np.linalg.norm(delta)))
        weight += n
    write_run(folder, [], {"r1": r1, "r2": {"base.w": r1["base.w"] + total / weight}},
              [{"round": 1, "devices": list(agents), "n_samples": sum(agents.values()),
                "secagg": {"session": 1, "devices": 3, "groups": [{"devices": 3, "released": True}]}}])
    for a, n in agents.items():
        head = {"classifier.weight": rng.normal(size=(4, 8)).astype(np.float32)}
        (folder / "agents" / a / "updates").mkdir(parents=True)
        write_checkpoint(folder / "agents" / a / "updates" / "r1.safetensors", {"base.w": updates[a]},
                         {"round": 1, "base_digest": "sha256:x", "n_samples": n})
        write_checkpoint(folder / "agents" / a / "device.safetensors", {"base.w": updates[a], **head},
                         {"round": 1, "local": ["classifier.weight"]})
        if leak_head and a == "agent-1":
            with open(folder / "capture.bin", "ab") as f:
                f.write(record(f"{BASE}/secagg/{a}", head["classifier.weight"].tobytes()))
    soak = json.loads((folder / "soak.json").read_text())
    (folder / "soak.json").write_text(json.dumps({**soak, "clip_norm": c}))


def test_checker_passes_an_honest_secure_round(tmp_path: Path) -> None:
    make_secure_round(tmp_path)
    result = chaos_check.check(tmp_path)
    assert result["violations"] == [] and result["verified"] == 1


@pytest.mark.parametrize("doctored", ["leave_out", "unclipped"])
def test_checker_finds_a_secure_release_other_than_the_clipped_mean(tmp_path: Path, doctored: str) -> None:
    make_secure_round(tmp_path, **{doctored: True})
    assert any("round 1: released model r2 is not r1 plus the weighted mean of its 3 clipped deltas" in v
               for v in chaos_check.check(tmp_path)["violations"])


def test_checker_passes_a_secure_round_released_unchanged_and_finds_one_that_moved(tmp_path: Path) -> None:
    """A round resumed after its unmask requests went out is released without any update (`secagg.abandoned`):
    r2 must be r1 itself."""
    rng = np.random.default_rng(5)
    r1 = {"base.w": rng.normal(size=(4, 8)).astype(np.float32)}
    line = {"round": 1, "devices": [], "n_samples": 0, "secagg": {"abandoned": True, "excluded": []}}
    for name, r2 in (("unchanged", r1), ("moved", {"base.w": r1["base.w"] + np.float32(0.01)})):
        write_run(tmp_path / name, [], {"r1": r1, "r2": r2}, [line])
        soak = json.loads((tmp_path / name / "soak.json").read_text())
        (tmp_path / name / "soak.json").write_text(json.dumps({**soak, "clip_norm": 20.0}))
    assert chaos_check.check(tmp_path / "unchanged")["violations"] == []
    assert any("released model r2 is not r1" in v for v in chaos_check.check(tmp_path / "moved")["violations"])


def test_checker_finds_an_agents_head_on_the_wire(tmp_path: Path) -> None:
    make_secure_round(tmp_path, leak_head=True)
    assert any("head tensor classifier.weight of agent-1" in v for v in chaos_check.check(tmp_path)["violations"])


@pytest.mark.mosquitto
@pytest.mark.soak
@pytest.mark.skipif(shutil.which("mosquitto") is None and not Path("/usr/sbin/mosquitto").exists(),
                    reason="mosquitto not installed (apt-get install mosquitto)")
@pytest.mark.long
def test_quick_soak_finds_no_violation(tmp_path: Path) -> None:
    """Async (scripted only) and sync modes side by side (sync with its 2 real agents, joining when they are up),
    15 s without faults and 30 s with coordinator SIGKILLs, broker restarts, device groups and agents killed with
    SIGKILL, devices leaving (some mid-upload), network cuts and, with libfaketime, clock jumps; the command exits 1
    on any violation."""
    done = subprocess.run([sys.executable, str(BENCH / "chaos_soak.py"), "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    for mode in ("sync", "async"):
        faults = json.loads((tmp_path / f"{mode}-faults" / "soak.json").read_text())
        assert {"coordinator_kill", "broker_restart", "devices_kill9"} <= set(faults["faults"]), faults["faults"]
        result = chaos_check.check(tmp_path / f"{mode}-faults")
        assert result["rounds"] >= 1 and result["verified"] >= 1
