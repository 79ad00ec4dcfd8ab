"""One device with valid credentials, hostile: the coordinator's engine against what it may send.

Every frame, registration and safetensors blob here is built by hand from docs/protocol.md (json,
struct, zlib, hashlib), never with fedper.wire's encoder, so a bug shared by the encoder and the
decoder cannot hide. Regression tests for the defects of issue 16 (a sample count beyond float
range jamming the round, a claimed sample count outweighing the fleet, a list-shaped safetensors
header and a metrics value beyond float range raising inside the coordinator), the sample-count
rules, a property-based test of the engine, and the measured bounds of each defence against a
poisoning device (docs/reliability.md, "Threat model").
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.frames import Raw, chunks, safetensors, to_json
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load
from vectors.make_vectors import tiny_manifest, tiny_tensors

from fedper.aggregation import CoordinateMedian, TrimmedMean, WeightedMean
from fedper.coordinator.config import DEFAULT_MAX_SAMPLES_PER_DEVICE, Config
from fedper.coordinator.durable import Coordinator
from fedper.coordinator.store import Store
from fedper.manifest import Manifest
from fedper.wire import (
    ERROR_CODES,
    MAX_JSON_INT,
    ErrorMessage,
    Outgoing,
    Register,
    RoundInfo,
    Topics,
    UpdateMeta,
    WireError,
)

MANIFEST = tiny_manifest()
FLEET = "lab"
BASE = f"fedper/v1/{FLEET}"


# ---------------------------------------------------------------- frames by hand (tests/helpers/frames.py)


def meta(n_samples: Any, round_: Any = 1, **more: Any) -> dict[str, Any]:
    return {"round": round_, "n_samples": n_samples, "base_digest": MANIFEST.base_digest, **more}


def registration(n_samples: Any, digest: str = MANIFEST.base_digest) -> bytes:
    return to_json({"v": 1, "n_samples": n_samples, "base_digest": digest, "software": "hand/1"}).encode()


def shifted(delta: float) -> dict[str, np.ndarray]:
    return {k: (v + np.float32(delta)).astype(np.float32) for k, v in tiny_tensors().items()}


# ---------------------------------------------------------------- driving the engine


def make(state: Path, manifest: Manifest = MANIFEST, initial: dict[str, np.ndarray] | None = None,
         **config: Any) -> Coordinator:
    settings_ = {"rounds": 2, "min_clients": 1, "round_timeout": 1e6, "chunk_size": 4096, **config}
    c = Coordinator(manifest, initial or tiny_tensors(), Topics(FLEET), Config.of(**settings_), Store(state))
    c.start(0.0)
    return c


def send(c: Coordinator, kind: str, device: str, payloads: list[bytes], now: float = 1.0) -> list[Outgoing]:
    out: list[Outgoing] = []
    for payload in payloads:
        out += c.handle(f"{BASE}/{kind}/{device}", payload, now)
    return out


def answers(out: list[Outgoing], device: str) -> list[str]:
    """The codes of the error messages sent to `device` (parsed with json, not fedper.wire)."""
    return [json.loads(m.payload)["code"] for m in out if m.topic == f"{BASE}/error/{device}"]


def update(c: Coordinator, device: str, tensors: dict[str, np.ndarray], n: Any, blob_id: str = "u1",
           **meta_more: Any) -> list[str]:
    return answers(send(c, "update", device, chunks(safetensors(tensors), meta(n, **meta_more), blob_id)), device)


def warnings_(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The coordinator's log records of level WARNING and above (a refusal is one)."""
    return [r for r in caplog.records if r.name == "fedper.coordinator" and r.levelno >= logging.WARNING]


def close(c: Coordinator) -> None:
    c.tick(2e6)  # past the deadline, with a quorum of 1
    assert c.round.number == 2 or c.finished


def assert_mean(model: dict[str, np.ndarray], weighted: list[tuple[dict[str, np.ndarray], int]]) -> None:
    total = sum(n for _, n in weighted)
    for name in model:
        expected = sum(t[name].astype(np.float64) * n for t, n in weighted) / total
        np.testing.assert_allclose(model[name], expected, rtol=1e-6, err_msg=name)


# ---------------------------------------------------------------- messages: every field checked


def test_messages_convert_to_and_from_dicts_and_every_field_is_bounded() -> None:
    """from_dict(to_dict(m)) is m, with no JSON in between; encode is {"v": 1} plus to_dict. Each field
    out of its bound (docs/protocol.md, section 4) is bad_message, whatever message it is in."""
    messages = [Register(10, "sha256:x", "s/1"), RoundInfo(1, 2, "open", 1.5, "r1", 10, "a" * 64, 1, "sha256:x"),
                UpdateMeta(1, 10, "sha256:x", {"accuracy": 0.5}, "fp16"), ErrorMessage("bad_message", "m", None)]
    for m in messages:
        assert type(m).from_dict(m.to_dict()) == m
        assert json.loads(m.encode()) == {"v": 1, **m.to_dict()}
    out_of_bounds = [
        (Register, {"n_samples": 0}), (Register, {"n_samples": MAX_JSON_INT + 1}), (Register, {"n_samples": 10**400}),
        (Register, {"n_samples": 1.0}), (Register, {"software": "x" * 257}), (Register, {"base_digest": None}),
        (RoundInfo, {"state": "closed"}), (RoundInfo, {"sha256": "A" * 64}), (RoundInfo, {"blob_id": "a/b"}),
        (RoundInfo, {"blob_id": "r1\n"}), (RoundInfo, {"deadline": 10**400}), (RoundInfo, {"deadline": math.inf}),
        (RoundInfo, {"round": 0}), (RoundInfo, {"size": -1}), (UpdateMeta, {"round": -1}),
        (UpdateMeta, {"metrics": {"a\n": 1}}), (UpdateMeta, {"metrics": {"loss": math.nan}}),
        (UpdateMeta, {"metrics": {"loss": True}}), (UpdateMeta, {"codec": ["fp16"]}),
        (ErrorMessage, {"round": 2**63}), (ErrorMessage, {"message": "x" * 4097}),
    ]
    for cls, change in out_of_bounds:
        fields_ = next(m for m in messages if type(m) is cls).to_dict()
        with pytest.raises(WireError) as refused:
            cls.from_dict({**fields_, **change})
        assert refused.value.code == "bad_message", (cls, change)
    assert ErrorMessage.from_dict({"code": "c", "message": "x" * 4096}).round is None  # optional, and the bound holds


# ---------------------------------------------------------------- all or nothing


@pytest.mark.parametrize("rule", [WeightedMean, CoordinateMedian, TrimmedMean])
def test_a_refused_add_leaves_every_rule_as_it_was(rule: type) -> None:
    """Every check runs before the rule changes: a refused update (a weight beyond float range, not
    positive, infinite, another layout or shape) leaves the result of the updates before it exact."""
    honest = [(shifted(1.0), 10), (shifted(3.0), 30)]
    r = rule()
    r.add(*honest[0])
    for tensors, n in [(shifted(9.0), 10**400), (shifted(9.0), 0), (shifted(9.0), math.inf), (shifted(9.0), -5),
                       ({"stem.weight": shifted(9.0)["stem.weight"]}, 10),
                       ({**shifted(9.0), "stem.bias": np.zeros(3, np.float32)}, 10),
                       ({**shifted(9.0), "extra": np.zeros(2, np.float32)}, 10),
                       ({**shifted(9.0), "stem.bias": np.array(["x", "y"], dtype=object)}, 10)]:
        with pytest.raises(ValueError):
            r.add(tensors, n)
    r.add(*honest[1])
    assert r.count == 2 and r.total_weight == 40.0
    clean = rule()
    for tensors, n in honest:
        clean.add(tensors, n)
    for name, value in clean.result().items():
        assert np.array_equal(r.result()[name], value), name


# ---------------------------------------------------------------- the defects of issue 16


def test_a_sample_count_beyond_float_range_neither_jams_the_round_nor_its_restart(tmp_path: Path) -> None:
    """Defect 1: an update with n_samples = 10**400 arriving first was folded half-way; every honest
    update after it was refused and a restart resumed the broken round. Now it is refused whole, once,
    before anything changes, and the honest updates make the round."""
    c = make(tmp_path)
    for device, n in (("evil", 10), ("a", 10), ("b", 30)):
        assert answers(send(c, "register", device, [registration(n)]), device) == []
    assert answers(send(c, "register", "huge", [registration(10**400)]), "huge") == ["bad_message"]
    assert "huge" not in c.registered
    assert update(c, "evil", shifted(100.0), 10**400) == ["bad_message"]  # 1 answer for its 1 blob of 2 chunks
    assert update(c, "a", shifted(1.0), 10) == []
    c = make(tmp_path)  # restarted: resumes a sound round
    assert set(c.round.folded) == {"a"}
    assert update(c, "b", shifted(3.0), 30) == []
    close(c)
    assert_mean(c.model, [(shifted(1.0), 10), (shifted(3.0), 30)])
    assert c.counters["bad_message"] == 2 and c.counters["accepted"] == 2 and c.counters["internal_error"] == 0


def test_a_claimed_sample_count_cannot_outweigh_the_fleet(tmp_path: Path) -> None:
    """Defect 2: n_samples = 10**12 on a well-formed update made the round's model the attacker's.
    A registration above --max-samples-per-device is refused (too_many_samples); an update must claim
    exactly what its device registered (n_samples_mismatch); the attacker keeps its registered weight."""
    c = make(tmp_path, max_samples_per_device=1000)
    assert answers(send(c, "register", "evil", [registration(10**12)]), "evil") == ["too_many_samples"]
    assert "evil" not in c.registered
    for device in ("evil", "a", "b"):
        send(c, "register", device, [registration(10)])
    assert update(c, "evil", shifted(1e3), 10**12, "x1") == ["too_many_samples"]
    assert update(c, "evil", shifted(1e3), 11, "x2") == ["n_samples_mismatch"]
    assert answers(send(c, "register", "evil", [registration(1001)]), "evil") == ["too_many_samples"]
    assert c.registered["evil"].n_samples == 10  # a refused registration changes nothing
    assert update(c, "evil", shifted(1e3), 10, "x3") == []
    assert update(c, "a", shifted(1.0), 10) == [] and update(c, "b", shifted(3.0), 10) == []
    close(c)
    assert_mean(c.model, [(shifted(1e3), 10), (shifted(1.0), 10), (shifted(3.0), 10)])
    assert {k: c.counters[k] for k in ("too_many_samples", "n_samples_mismatch")} == {
        "too_many_samples": 3, "n_samples_mismatch": 1}


def test_the_default_cap_is_documented_and_admits_it(tmp_path: Path) -> None:
    c = make(tmp_path)
    assert c.config.quotas.max_samples_per_device == DEFAULT_MAX_SAMPLES_PER_DEVICE == 1_000_000
    assert answers(send(c, "register", "big", [registration(1_000_000)]), "big") == []
    assert answers(send(c, "register", "bigger", [registration(1_000_001)]), "bigger") == ["too_many_samples"]
    doc = (Path(__file__).parents[1] / "docs" / "protocol.md").read_text()
    assert [code for code in ERROR_CODES if f"| `{code}` |" not in doc] == []  # every code in the error table


def test_a_registration_change_applies_to_later_updates_only(tmp_path: Path) -> None:
    """A device may re-register another n_samples at any time (within the cap): an update must then
    claim the new one; an update already folded keeps the weight it was folded with."""
    c = make(tmp_path)
    for device, n in (("a", 10), ("b", 30)):
        send(c, "register", device, [registration(n)])
    assert update(c, "a", shifted(1.0), 10) == []
    send(c, "register", "a", [registration(50)])
    send(c, "register", "b", [registration(20)])
    assert update(c, "b", shifted(3.0), 30, "old") == ["n_samples_mismatch"]
    assert update(c, "b", shifted(3.0), 20, "new") == []
    close(c)
    assert_mean(c.model, [(shifted(1.0), 10), (shifted(3.0), 20)])
    assert update(c, "a", shifted(1.0), 10, "r2", round_=2) == ["n_samples_mismatch"]


def test_a_device_re_registering_in_a_loop_costs_no_checkpoint_per_message(tmp_path: Path) -> None:
    """Registrations change at the device's will; each change was an fsynced state.json. Driven as the
    service drives it (handle, then tick) at 2,000 changes a second for a second, the engine writes
    state.json at most once per state_interval (0.5 s), the last registration is the one checkpointed,
    and an honest device's update in between is folded at once."""
    c = make(tmp_path)
    send(c, "register", "honest", [registration(30)])
    c.tick(0.5)
    state = tmp_path / "state.json"
    writes, inode = 0, state.stat().st_ino
    for i in range(2000):
        now = 1.0 + i / 2000
        send(c, "register", "flipper", [registration(10 + i % 2)], now)
        if i == 1000:
            assert answers(send(c, "update", "honest", chunks(safetensors(shifted(1.0)), meta(30)), now),
                           "honest") == [] and "honest" in c.round.folded
        c.tick(now)
        writes, inode = writes + (state.stat().st_ino != inode), state.stat().st_ino
    assert writes <= 4, writes  # two for the pace, one for the fold, and one to spare
    c.tick(5.0)
    saved = json.loads(state.read_text())
    registry = Store(tmp_path).load_registry(saved)
    assert registry["flipper"]["n_samples"] == 11 and "honest" in saved["round"]["folded"]


HEADERS = {"list": [1, 2], "empty list": [], "string": "x", "number": 7, "huge number": Raw("1e400"), "null": None,
           "true": True, "nested": {"stem.weight": [[{"dtype": "F32"}]]}, "metadata list": {"__metadata__": [1]},
           "codec list": {"__metadata__": {"fedper.codec": ["int8"]}}}


@pytest.mark.parametrize("shape", list(HEADERS))
def test_a_safetensors_header_of_any_json_type_is_refused_once(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                shape: str) -> None:
    """Defect 5: a list-shaped safetensors header raised inside the coordinator (internal_error, a
    traceback per chunk, no answer). Every JSON type is now refused as bad_tensors: one answer and one
    log line per blob, and the device's honest update that follows is folded."""
    c = make(tmp_path)
    send(c, "register", "d", [registration(10)])
    blob = safetensors(shifted(1.0), header=HEADERS[shape])
    frames = chunks(blob + b"\x00" * 64, meta(10), "bad", chunk_size=16)
    assert len(frames) > 3
    with caplog.at_level(logging.WARNING, logger="fedper.coordinator"):
        assert answers(send(c, "update", "d", frames), "d") == ["bad_tensors"]
    assert [r.getMessage()[:27] for r in warnings_(caplog)] == ["rejected bad_tensors from d"]
    assert c.counters["internal_error"] == 0
    assert update(c, "d", shifted(1.0), 10, "good") == []


@pytest.mark.parametrize("metrics", [{"loss": 10**400}, {"loss": -1e16}, {"loss": 1e300},
                                     {"accuracy": "0.9"}, {"accuracy": [0.9]}, {"accuracy": None},
                                     {"bad/name": 0.5}, {f"m{i}": 0.5 for i in range(17)}, [0.5], "fast"])
def test_metrics_beyond_float_range_or_shape_are_refused_once(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                              metrics: Any) -> None:
    """Defect 5: a metrics value too large for a float raised inside the coordinator, once per chunk,
    unanswered. Metrics are checked with the rest of the message: finite, |value| <= 1e15, at most
    16 entries named like a topic level."""
    c = make(tmp_path)
    send(c, "register", "d", [registration(10)])
    with caplog.at_level(logging.WARNING, logger="fedper.coordinator"):
        assert update(c, "d", shifted(1.0), 10, "bad", metrics=metrics) == ["bad_message"]
    assert [r.getMessage()[:27] for r in warnings_(caplog)] == ["rejected bad_message from d"]
    assert update(c, "d", shifted(1.0), 10, "good", metrics={"accuracy": 0.5, "loss": 1e15}) == []
    close(c)
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record["accuracy_mean"] == 0.5 and record["rejected"] == {"bad_message": 1}


@pytest.mark.parametrize("field_, value", [
    ("index", -1), ("index", 2**63), ("index", 10**400), ("count", 0), ("count", 2**53), ("size", -1),
    ("size", 10**400), ("chunk_size", 0), ("chunk_size", 2**63), ("chunk_size", 1.5), ("index", True),
    ("blob_id", "../x"), ("blob_id", ["u"]), ("sha256", "0" * 63), ("sha256", None), ("meta", [1]), ("v", True),
    ("v", 1.0), ("v", 2),
])
def test_chunk_fields_out_of_range_are_refused(tmp_path: Path, field_: str, value: Any) -> None:
    c = make(tmp_path)
    send(c, "register", "d", [registration(10)])
    out = send(c, "update", "d", chunks(safetensors(shifted(1.0)), meta(10), "bad", 4096, {field_: value}))
    assert answers(out, "d") in (["bad_chunk"], ["bad_message"])
    assert update(c, "d", shifted(1.0), 10, "good") == []


def test_an_internal_error_is_answered_and_logged_once_per_blob(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """Input can no longer provoke a bug, so this one test injects one (the only stand-in in this file):
    the update that meets it is refused as internal_error once for its whole blob, with one log
    record holding the traceback; the service goes on and the device's next blob is folded."""
    c = make(tmp_path)
    send(c, "register", "d", [registration(10)])
    prepared = c.strategy._prepared

    def bug(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise KeyError("a bug")

    c.strategy._prepared = bug  # type: ignore[method-assign]
    frames = chunks(safetensors(shifted(1.0)), meta(10), "hit", chunk_size=16)
    with caplog.at_level(logging.WARNING, logger="fedper.coordinator"):
        out = send(c, "update", "d", frames + frames)  # the whole blob, then again: refused once
    assert answers(out, "d") == ["internal_error"]
    [record] = warnings_(caplog)
    assert record.getMessage().startswith("rejected internal_error from d") and record.exc_info is not None
    assert c.counters["internal_error"] == 1 and json.loads(c.state_message(2.0).payload)["counters"][
        "internal_error"] == 1
    c.strategy._prepared = prepared  # type: ignore[method-assign]
    assert update(c, "d", shifted(1.0), 10, "next") == []


# ---------------------------------------------------------------- threat model: a poisoning device


def poisoning_manifest() -> Manifest:
    """A model of 1,025 shared coordinates (and a head), enough for coordinate-wise rules to mean something."""
    from fedper.manifest import ModelInfo, TensorSpec

    info = ModelInfo("toy", kp=1, num_classes=3, input_shape=(3, 1, 1), mean=(0.0,) * 3, std=(1.0,) * 3)
    return Manifest(model=info, algorithm="fedper", tensors=(
        TensorSpec("w", (40, 25), "float32", "base", True, True), TensorSpec("b", (25,), "float32", "base", True, True),
        TensorSpec("head", (3, 2), "float32", "head", True, False)))


DEFENCES = {"none (mean, cap lifted)": {"max_weight_ratio": math.inf}, "mean, default weight cap": {},
            "--clip-norm 1.5": {"clip_norm": 1.5}, "--aggregator median": {"aggregator": "median"},
            "--aggregator trimmed-mean": {"aggregator": "trimmed-mean"}}


def test_each_defence_bounds_a_poisoning_device(tmp_path: Path) -> None:
    """Threat model (docs/reliability.md): a device with valid credentials sends a well-formed update, the
    honest devices' round step flipped and boosted 10x; once with the weight of an honest device (100
    samples), once registered at the default cap (1,000,000). 4 honest devices step by g + noise (|g| = 1).
    Measured: the round model's distance to the honest devices' mean, in units of the honest step. Without
    a defence it follows the attacker; the default weight cap (10 x the median registered count, 100 here)
    gives it a weight of at most 1,000, so the model is exactly (100 sum h_i + min(n, 1000) p) / (400 +
    min(n, 1000)), recomputed here in float64; --clip-norm C bounds it by (C + step) whatever the claimed
    weight; median and trimmed-mean keep every coordinate within the honest updates' range."""
    manifest = poisoning_manifest()
    rng = np.random.default_rng(16)
    base = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in manifest.shared_tensors}
    size = sum(v.size for v in base.values())
    g = {k: (rng.standard_normal(v.shape) / np.sqrt(size)).astype(np.float32) for k, v in base.items()}
    honest = [{k: base[k] + g[k] + (0.3 * rng.standard_normal(v.shape) / np.sqrt(size)).astype(np.float32)
               for k, v in base.items()} for _ in range(4)]
    poison = {k: base[k] - 10 * g[k] for k in base}
    flat = lambda t: np.concatenate([np.asarray(t[k], np.float64).ravel() for k in ("w", "b")])  # noqa: E731
    honest_mean, stack = np.mean([flat(h) for h in honest], axis=0), np.stack([flat(h) for h in honest])
    step = float(np.linalg.norm(honest_mean - flat(base)))
    digest = manifest.base_digest
    table = {}
    for attack, attacker_n in (("boosted x10, honest weight", 100), ("boosted x10, at the cap", 1_000_000)):
        for defence, config in DEFENCES.items():
            c = make(tmp_path / f"{attacker_n}-{defence}", manifest, base, rounds=1, min_clients=5, **config)
            devices = [(f"h{i}", h, 100) for i, h in enumerate(honest)] + [("evil", poison, attacker_n)]
            for device, tensors, n in devices:
                assert answers(send(c, "register", device, [registration(n, digest)]), device) == []
                m = {"round": 1, "n_samples": n, "base_digest": digest}
                assert answers(send(c, "update", device, chunks(safetensors(tensors), m, "u", 4096)), device) == []
            c.tick(2.0)
            assert c.finished
            result = flat(c.model)
            distance = float(np.linalg.norm(result - honest_mean)) / step
            table[attack, defence] = distance
            if defence.startswith("none"):
                assert distance > (2.0 if attacker_n == 100 else 10.0)
            elif "cap" in defence:
                weight = min(attacker_n, 10 * 100)
                expected = (100 * stack.sum(axis=0) + weight * flat(poison)) / (400 + weight)
                np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-6)
                assert distance < 8.0 if attacker_n > weight else distance > 2.0
            elif "clip" in defence:
                assert distance <= (1.5 + step) / step
            else:
                assert np.all(result >= stack.min(axis=0) - 1e-6) and np.all(result <= stack.max(axis=0) + 1e-6)
                assert distance < 1.0
    print(f"\nround model's distance to the honest mean, in honest steps (|step| = {step:.3f}):")
    for (attack, defence), distance in table.items():
        print(f"  {attack:28s} {defence:28s} {distance:8.3f}")


# ---------------------------------------------------------------- property-based: hand-built frames


EXTREME_INTS = st.sampled_from([10**400, -(10**400), -1, 0, 1, 2**31, 2**53 - 1, 2**53, 2**63, 2**64, -(2**63)])
EXTREME_FLOATS = st.sampled_from([1e308, -1e308, 5e-324, -0.0, 1e15, 1e16]) | st.floats(allow_nan=False,
                                                                                       allow_infinity=False)
RAW_NUMBERS = st.sampled_from(["1e400", "-1e400", "1e-400", "1E+999999", "123456789" * 60, "-0", "0.0e0"]).map(Raw)
SCALARS = st.none() | st.booleans() | st.integers() | EXTREME_INTS | EXTREME_FLOATS | RAW_NUMBERS | st.text(max_size=8)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                         max_size=3), max_leaves=8)
META_KEYS = st.sampled_from(["round", "n_samples", "base_digest", "metrics", "codec", "extra"])
HEADER_KEYS = st.sampled_from(["v", "blob_id", "index", "count", "size", "chunk_size", "sha256", "meta"])
REGISTER_KEYS = st.sampled_from(["v", "n_samples", "base_digest", "software"])
HONEST = shifted(2.0)
FAST_DIR = "/dev/shm" if Path("/dev/shm").is_dir() else None  # a state dir per example: fsync in memory, where there
EVIL_N = 10


@st.composite
def hostile(draw: st.DrawFn, blob_id: str) -> tuple[str, str, bytes, Any, bool]:
    """(kind, device, payload, blob_id, may_wait): a registration or an update chunk with some fields
    replaced by any JSON, a safetensors header of any JSON type, raw bytes, or a presence. may_wait: a
    well-formed chunk of a blob of several chunks, which waits for the rest unanswered."""
    device = draw(st.sampled_from(["evil", "ghost"]))
    what = draw(st.sampled_from(["register", "update", "update", "update", "bytes", "presence"]))
    if what == "presence":
        status = draw(st.sampled_from([b"online", b"offline", b""]) | st.binary(max_size=16))
        return "presence", device, status, None, False
    if what == "bytes":
        return draw(st.sampled_from(["register", "update"])), device, draw(st.binary(max_size=64)), None, False
    if what == "register":
        body = {"v": 1, "n_samples": EVIL_N, "base_digest": MANIFEST.base_digest, "software": "x"}
        body.update(draw(st.dictionaries(REGISTER_KEYS, JSON, max_size=2)))
        return "register", device, to_json(body).encode(), None, False
    tensors = draw(st.sampled_from([HONEST, shifted(1e38), {**HONEST, "stem.bias": np.array([np.nan, 0], "f4")}]))
    blob = safetensors(tensors, header=draw(st.none() | JSON))  # None: the honest safetensors header
    m = meta(EVIL_N)
    m.update(draw(st.dictionaries(META_KEYS, JSON, max_size=2)))
    overrides = draw(st.dictionaries(HEADER_KEYS, JSON | EXTREME_INTS, max_size=2))
    size = draw(st.sampled_from([4096, 64]))
    frames = chunks(blob, m, blob_id, size, overrides)
    index = draw(st.integers(0, len(frames) - 1))
    well_formed = frames[index] == chunks(blob, m, blob_id, size, {})[index]  # no override changed this one
    return "update", device, frames[index], to_json(overrides.get("blob_id", blob_id)), len(frames) > 1 and well_formed


def test_hostile_frames_never_raise_are_answered_and_leave_the_honest_update_exact() -> None:
    """Property: whatever a device sends (hand-built frames: extreme integers and floats, nested and
    list-shaped JSON, safetensors headers of any JSON type, chunk fields out of range), handle() never
    raises and answers on the sender's error topic every message it did not accept (a chunk of a blob
    it already refused, or one waiting for the rest of its blob, excepted); an honest device's update
    sent afterwards in the same round is accepted and aggregated exactly, bit for bit."""

    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(st.integers(0, 10**6).flatmap(lambda i: hostile(f"b{i}")), min_size=1, max_size=12))
    def property_(messages: list[tuple[str, str, bytes, Any, bool]]) -> None:
        with tempfile.TemporaryDirectory(dir=FAST_DIR) as tmp:
            state = Path(tmp)
            c = make(state)
            send(c, "register", "evil", [registration(EVIL_N)])
            send(c, "register", "honest", [registration(30)])
            refused: set[tuple[str, Any]] = set()
            for i, (kind, device, payload, blob_id, may_wait) in enumerate(messages):
                out = c.handle(f"{BASE}/{kind}/{device}", payload, 1.0 + i / 100)  # never raises
                assert len(out) <= 1 and all(m.topic == f"{BASE}/error/{device}" for m in out), out
                event(f"{kind}: {answers(out, device) or 'unanswered'}")
                if out:
                    refused.add((device, blob_id))
                elif kind == "register":
                    assert payload == b"" or device in c.registered, payload  # accepted (or the device left)
                elif kind == "presence":
                    assert payload in (b"online", b"offline", b""), payload
                else:
                    assert device in c.round.folded or may_wait or (device, blob_id) in refused, payload[:300]
            assert c.counters["internal_error"] == 0
            out = send(c, "update", "honest", chunks(safetensors(HONEST), meta(30), "h1"), 5.0)
            assert answers(out, "honest") == [] and "honest" in c.round.folded
            kept = json.loads((state / "state.json").read_text())["strategy"]["updates"]  # what the engine wrote
            weighted = [(HONEST if d == "honest" else load((state / kept[d]["file"]).read_bytes()[:kept[d]["size"]]),
                         f.n_samples) for d, f in c.round.folded.items()]  # in the order they were folded
            close(c)
            for name in HONEST:  # the engine's arithmetic redone: float64 Σ n_j W_j, times 1 / Σ n_j, float32
                total = np.zeros(HONEST[name].shape, np.float64)
                for tensors, n in weighted:
                    total += tensors[name].astype(np.float64) * float(n)
                expected = (total * (1.0 / sum(n for _, n in weighted))).astype(np.float32)
                assert np.array_equal(c.model[name], expected), (name, c.model[name], expected)

    property_()
