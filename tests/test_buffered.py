"""FedBuff's buffer (fedper/buffered.py): each expected model is worked out by hand from the paper's rule,
model + server_lr * Σ n_j w(s_j) Δ_j / Σ n_j, on numbers chosen so that float64 holds every step exactly."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from fedper import checkpoint
from fedper.aggregation import weighted_mean
from fedper.buffered import Buffer, BufferConfig, Refused, Staleness, base_delta


def _model() -> dict[str, np.ndarray]:
    return {"w": np.array([1.0, 2.0], np.float32), "b": np.array([0.5], np.float32)}


def _delta(w: list[float], b: float) -> dict[str, np.ndarray]:
    return {"w": np.array(w), "b": np.array([b])}


def test_a_release_is_the_buffers_staleness_weighted_mean_step_by_hand() -> None:
    """Version 3 is current; a fresh delta (s = 0, w = 1, n = 1) and one trained on version 0 (s = 3,
    w = 1/sqrt(4) = 1/2, n = 3). Step = (1 * d1 + 3 * 1/2 * d2) / (1 + 3), times server_lr 1/2:
    w: (1 * [0.25, -1] + 1.5 * [1, 0.5]) / 4 = [1.75, -0.25] / 4 = [0.4375, -0.0625]; halved [0.21875, -0.03125]
    b: (1 * 2 + 1.5 * -4) / 4 = -4 / 4 = -1; halved -0.5."""
    buffer = Buffer(BufferConfig(buffer_size=2, max_staleness=3, server_lr=0.5), _model(), version=3)
    record, release = buffer.fold(_delta([0.25, -1.0], 2.0), 1, version=3, update_id="a")
    assert release is None and (record.staleness, record.weight) == (0, 1.0)
    record, release = buffer.fold(_delta([1.0, 0.5], -4.0), 3, version=0, update_id="b")
    assert (record.staleness, record.weight) == (3, 0.5)
    assert release is not None and release.version == buffer.version == 4
    assert release.model["w"].dtype == np.float32
    assert release.model["w"].tolist() == [1.21875, 1.96875]
    assert release.model["b"].tolist() == [0.0]
    assert [r.update_id for r in release.folded] == ["a", "b"] and buffer.folded == []


def test_staleness_one_weighs_one_over_sqrt_two() -> None:
    """One delta a version old alone in a buffer of K = 1: the step is w(1) * d = d / sqrt(2) (n cancels)."""
    buffer = Buffer(BufferConfig(buffer_size=1, max_staleness=5), {"w": np.zeros(2)}, version=1)
    _, release = buffer.fold({"w": np.array([1.0, -3.0])}, 7, version=0, update_id="x")
    assert release is not None
    np.testing.assert_allclose(release.model["w"], [1 / math.sqrt(2), -3 / math.sqrt(2)], rtol=1e-15)


@pytest.mark.parametrize(("staleness", "s", "expected"), [
    (Staleness(), 0, 1.0), (Staleness(), 3, 0.5), (Staleness(), 8, 1 / 3),
    (Staleness("polynomial", a=1.0), 4, 0.2),
    (Staleness("constant"), 50, 1.0),
    (Staleness("hinge", a=0.5, b=2), 2, 1.0), (Staleness("hinge", a=0.5, b=2), 4, 0.5),
    (Staleness("hinge", a=0.25, b=0), 12, 0.25),
])
def test_staleness_functions_by_hand(staleness: Staleness, s: int, expected: float) -> None:
    assert staleness.weight(s) == pytest.approx(expected, rel=1e-15)


def test_the_denominator_is_the_sample_count_not_the_staleness_weights() -> None:
    """FedBuff divides by K (here Σ n_j), not by Σ w_j n_j: a buffer of stale deltas takes a shorter step.
    Two deltas of [1] each 3 versions old (w = 1/2), n = 2 each: (2 * 0.5 + 2 * 0.5) / 4 = 0.5, not 1."""
    buffer = Buffer(BufferConfig(buffer_size=2, max_staleness=3), {"w": np.zeros(1)}, version=3)
    buffer.fold({"w": np.ones(1)}, 2, version=0, update_id="a")
    _, release = buffer.fold({"w": np.ones(1)}, 2, version=0, update_id="b")
    assert release is not None and release.model["w"].tolist() == [0.5]


def test_fresh_deltas_at_server_lr_one_give_the_synchronous_mean() -> None:
    """Staleness 0, K = the round's updates, server_lr 1: model + mean(trained - model) = mean(trained)."""
    rng = np.random.default_rng(3)
    model = {"w": rng.standard_normal((4, 3)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}
    trained = [({n: (v + rng.standard_normal(v.shape)).astype(np.float32) for n, v in model.items()}, n)
               for n in (10, 250, 33)]
    buffer = Buffer(BufferConfig(buffer_size=3, max_staleness=0), model)
    for i, (tensors, n) in enumerate(trained):
        _, release = buffer.fold(base_delta(tensors, model), n, version=0, update_id=str(i))
    assert release is not None
    synchronous = weighted_mean([({k: v.astype(np.float64) for k, v in t.items()}, n) for t, n in trained])
    for name, value in release.model.items():
        np.testing.assert_allclose(value, synchronous[name], rtol=1e-6, atol=1e-6)


def test_statistics_are_averaged_by_value_not_stepped() -> None:
    """A running variance "rv" at 4 in version 0. Two fresh deltas (-3.75 each: values 0.25) release version 1
    with rv 0.25 and w 0 + (1 + 3) / 2 = 2. Then B (trained on version 0, s = 1, w(1) = 1/2 with a = 1, n = 1,
    rv value 4 - 3.5 = 0.5, w delta 2) and C (version 1, s = 0, n = 3, rv value 0.25 + 0.5 = 0.75, w delta -1):
    w = 2 + (1 * 1/2 * 2 + 3 * -1) / (1 + 3) = 1.5; rv = (1/2 * 1 * 0.5 + 1 * 3 * 0.75) / (1/2 + 3) = 5/7.
    Stepped like w, rv would be 0.25 + (1 * 1/2 * -3.5 + 3 * 0.5) / 4 = 0.1875; with B alone, 0.25 - 1.75 < 0."""
    config = BufferConfig(buffer_size=2, max_staleness=2, staleness=Staleness("polynomial", a=1.0),
                          statistics=("rv",))
    buffer = Buffer(config, {"w": np.zeros(1, np.float32), "rv": np.full(1, 4.0, np.float32)})
    buffer.fold({"w": np.array([1.0]), "rv": np.array([-3.75])}, 1, version=0, update_id="a1")
    _, release = buffer.fold({"w": np.array([3.0]), "rv": np.array([-3.75])}, 1, version=0, update_id="a2")
    assert release is not None and (release.model["w"].tolist(), release.model["rv"].tolist()) == ([2.0], [0.25])
    buffer.fold({"w": np.array([2.0]), "rv": np.array([-3.5])}, 1, version=0, update_id="b")
    _, release = buffer.fold({"w": np.array([-1.0]), "rv": np.array([0.5])}, 3, version=1, update_id="c")
    assert release is not None and release.model["w"].tolist() == [1.5]
    np.testing.assert_allclose(release.model["rv"], [5 / 7], rtol=1e-7)
    late = Buffer(config, {"w": np.zeros(1), "rv": np.ones(1)}, version=2)  # started at 2: no statistics of 1
    with pytest.raises(Refused, match="no statistics of version 1"):
        late.fold({"w": np.ones(1), "rv": np.ones(1)}, 1, version=1, update_id="x")


def _state(buffer: Buffer) -> tuple[dict[str, list], dict]:
    tensors, meta = buffer.checkpoint()
    return {k: v.tolist() for k, v in tensors.items()}, meta


def test_refusals_leave_the_buffer_as_it_was() -> None:
    """Too stale, a version not released, an id folded already, a wrong layout, a bad sample count."""
    buffer = Buffer(BufferConfig(buffer_size=3, max_staleness=2), _model(), version=5)
    buffer.fold(_delta([1.0, 1.0], 1.0), 4, version=3, update_id="dev-1@3")  # s = 2: the oldest allowed
    before = _state(buffer)
    with pytest.raises(Refused) as refused:
        buffer.fold(_delta([1.0, 1.0], 1.0), 4, version=2, update_id="dev-2@2")  # s = 3
    assert refused.value.reason == "too_stale"
    for version in (6, -1):
        with pytest.raises(Refused) as refused:
            buffer.fold(_delta([1.0, 1.0], 1.0), 4, version=version, update_id="dev-3")
        assert refused.value.reason == "unknown_version"
    with pytest.raises(Refused) as refused:
        buffer.fold(_delta([9.0, 9.0], 9.0), 4, version=4, update_id="dev-1@3")
    assert refused.value.reason == "duplicate"
    with pytest.raises(ValueError, match="layout"):
        buffer.fold({"w": np.ones(3), "b": np.ones(1)}, 4, version=5, update_id="dev-4")
    with pytest.raises(ValueError, match="sample count"):
        buffer.fold(_delta([1.0, 1.0], 1.0), 0, version=5, update_id="dev-5")
    assert _state(buffer) == before


def test_an_id_stays_refused_while_its_version_is_within_the_window() -> None:
    """K = 1, max_staleness 1: "a" (version 0) is remembered until version 2, when it would be too stale anyway."""
    buffer = Buffer(BufferConfig(buffer_size=1, max_staleness=1), {"w": np.zeros(1)})
    buffer.fold({"w": np.ones(1)}, 1, version=0, update_id="a")  # releases version 1
    with pytest.raises(Refused, match="folded already"):
        buffer.fold({"w": np.ones(1)}, 1, version=0, update_id="a")
    buffer.fold({"w": np.ones(1)}, 1, version=1, update_id="b")  # releases version 2
    assert set(buffer.seen) == {"b"}
    with pytest.raises(Refused) as refused:
        buffer.fold({"w": np.ones(1)}, 1, version=0, update_id="a")
    assert refused.value.reason == "too_stale"


def test_clipping_scales_the_delta_before_its_staleness_weight() -> None:
    """A delta [3, 4] (norm 5) clipped to 1 is [0.6, 0.8]; 3 versions old it weighs 1/2: step [0.3, 0.4]."""
    buffer = Buffer(BufferConfig(buffer_size=1, max_staleness=3, clip_norm=1.0), {"w": np.zeros(2)}, version=3)
    _, release = buffer.fold({"w": np.array([3.0, 4.0])}, 5, version=0, update_id="a")
    assert release is not None
    np.testing.assert_allclose(release.model["w"], [0.3, 0.4], rtol=1e-15)


def test_a_robust_rule_takes_the_scaled_deltas_and_ignores_sample_counts() -> None:
    """Median of [1], [100] (s = 3: 1/2 of it, 50) and [4]: 4, whatever the sample counts claim."""
    buffer = Buffer(BufferConfig(buffer_size=3, max_staleness=3, aggregator="median"), {"w": np.ones(1)}, version=3)
    buffer.fold({"w": np.array([1.0])}, 1, version=3, update_id="a")
    buffer.fold({"w": np.array([100.0])}, 10**6, version=0, update_id="b")
    _, release = buffer.fold({"w": np.array([4.0])}, 1, version=3, update_id="c")
    assert release is not None and release.model["w"].tolist() == [5.0]


@pytest.mark.parametrize("aggregator", ["mean", "trimmed-mean"])
def test_a_resumed_buffer_continues_bit_for_bit(tmp_path, aggregator: str) -> None:
    """Checkpoint (safetensors + JSON, through fedper.checkpoint) with 2 of K = 3 deltas folded, resume,
    fold the same deltas into both: the releases are the same bits, and an id folded before stays refused."""
    rng = np.random.default_rng(5)
    model = {"conv": rng.standard_normal((3, 2, 2)).astype(np.float32), "fc": rng.standard_normal(5).astype(np.float32),
             "bn.running_var": rng.random(2).astype(np.float32)}
    config = BufferConfig(buffer_size=3, max_staleness=4, server_lr=0.7, aggregator=aggregator,
                          statistics=("bn.running_var",))
    deltas = [({n: rng.standard_normal(v.shape) * 0.1 for n, v in model.items()}, int(rng.integers(1, 500)))
              for _ in range(8)]
    original = Buffer(config, model)
    for i, (delta, n) in enumerate(deltas[:5]):  # one release, then 2 in the open buffer
        original.fold(delta, n, version=max(0, original.version - i % 2), update_id=f"u{i}")
    tensors, meta = original.checkpoint()
    checkpoint.write_checkpoint(tmp_path / "buffer.safetensors", tensors, meta)
    resumed = Buffer.resume(config, *checkpoint.read_checkpoint(tmp_path / "buffer.safetensors"))
    assert _state(resumed) == _state(original)
    assert list(resumed.model) == list(original.model) == ["conv", "fc", "bn.running_var"]
    with pytest.raises(Refused, match="folded already"):
        resumed.fold(deltas[0][0], 1, version=resumed.version, update_id="u4")
    releases = []
    for buffer in (original, resumed):
        out = [buffer.fold(delta, n, version=buffer.version, update_id=f"u{i + 5}")[1]
               for i, (delta, n) in enumerate(deltas[5:])]
        releases.append([r for r in out if r is not None])
    assert [r.version for r in releases[0]] == [r.version for r in releases[1]] == [2]
    for name in model:
        assert releases[0][0].model[name].tobytes() == releases[1][0].model[name].tobytes()
    with pytest.raises(ValueError, match="same settings"):
        Buffer.resume(replace(config, buffer_size=4), tensors, meta)


@pytest.mark.parametrize("bad", [
    {"buffer_size": 0, "max_staleness": 1}, {"buffer_size": 2, "max_staleness": -1},
    {"buffer_size": 2, "max_staleness": 1, "server_lr": 0.0}, {"buffer_size": 2, "max_staleness": 1, "clip_norm": -1.0},
    {"buffer_size": 2, "max_staleness": 1, "aggregator": "max"}, {"buffer_size": True, "max_staleness": 1},
])
def test_bad_settings_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        BufferConfig(**bad)
    with pytest.raises(ValueError, match="staleness function"):
        Staleness("exponential")
