"""DP-FedAvg (fedper.privacy): clipping, the fixed-denominator noised mean, adaptive clipping, the accountant."""

from __future__ import annotations

import json
import math

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import rdp

from fedper.aggregation import WeightedMean
from fedper.models import build_model, describe, exported_state
from fedper.privacy import (
    AdaptiveClipping,
    DPFedAvg,
    PrivacyAccountant,
    budget_action,
    clip_delta,
    delta_norm,
    dp_event,
    expected_weight,
    noise_multiplier_for,
    prepare_release,
    private_tensor_names,
    round_generator,
)

SHAPES = {"conv.weight": (8, 3, 3, 3), "conv.bias": (8,), "fc.weight": (10, 32)}


def model(rng: np.random.Generator, shapes: dict[str, tuple[int, ...]] = SHAPES) -> dict[str, np.ndarray]:
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def update_of_norm(reference: dict[str, np.ndarray], norm: float, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """reference + a random direction of L2 norm `norm` over all tensors (float32 rounding aside)."""
    direction = model(rng, {name: value.shape for name, value in reference.items()})
    scale = norm / math.sqrt(sum(float((d.astype(np.float64) ** 2).sum()) for d in direction.values()))
    return {name: (reference[name] + direction[name] * scale).astype(np.float32) for name in reference}


def rule(reference: dict, *, clip: float = 1.0, z: float = 0.0, m: float = 1.0, seed: int = 0, **kw) -> DPFedAvg:
    return DPFedAvg(reference, clip_norm=clip, noise_multiplier=z, expected_weight=m,
                    rng=np.random.default_rng(seed), **kw)


def test_clipping_bound_holds_exactly() -> None:
    rng = np.random.default_rng(1)
    reference = model(rng)
    for norm in (0.5, 1.0, 3.0, 1e3, 1e6):
        update = update_of_norm(reference, norm, rng)
        clipped = clip_delta(update, reference, 1.0, SHAPES)
        clipped_norm = math.sqrt(sum(float((d * d).sum()) for d in clipped.values()))
        assert clipped_norm <= 1.0 + 1e-12
        if delta_norm(update, reference, SHAPES) > 1.0:
            assert clipped_norm == pytest.approx(1.0, abs=1e-12)
        # through the rule too (no noise, one device, denominator 1): the released step is within C
        dp = rule(reference, clip=1.0)
        assert dp.add(update, 10) == pytest.approx(delta_norm(update, reference, SHAPES))
        released = dp.result()
        assert delta_norm(released, reference, SHAPES) <= 1.0 + 1e-6  # float32 rounding of reference + step


def test_unclipped_updates_pass_unchanged_numpy_and_torch() -> None:
    rng = np.random.default_rng(2)
    reference = model(rng)
    update = update_of_norm(reference, 0.3, rng)
    dp = rule(reference, clip=1.0)
    dp.add(update, 5)
    released = dp.result()
    assert dp.unclipped == 1
    for name in SHAPES:
        assert released[name].dtype == np.float32
        np.testing.assert_array_equal(released[name], update[name])
    as_torch = {name: torch.from_numpy(value) for name, value in reference.items()}
    dp_torch = rule(as_torch, clip=1.0)
    dp_torch.add({name: torch.from_numpy(value) for name, value in update.items()}, 5)
    for name, value in dp_torch.result().items():
        assert value.dtype == torch.float32
        np.testing.assert_array_equal(value.numpy(), update[name])


def test_noise_std_is_z_c_over_m_and_seeded() -> None:
    """Updates equal to the round model: the released model minus the reference is the noise alone."""
    shapes = {"w": (100, 100), "b": (100,)}
    reference = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
    z, clip, m = 1.3, 0.7, 10.0
    gen = np.random.default_rng(3)
    draws = []
    for _ in range(20):  # 20 rounds x 10,100 coordinates
        dp = DPFedAvg(reference, clip_norm=clip, noise_multiplier=z, expected_weight=m, rng=gen)
        for _ in range(3):
            dp.add(reference, 4)
        draws.append(np.concatenate([v.astype(np.float64).ravel() for v in dp.result(np.float64).values()]))
    noise = np.concatenate(draws)
    assert dp.noise_std == pytest.approx(z * clip / m)
    assert noise.std() == pytest.approx(z * clip / m, rel=0.02)
    assert abs(noise.mean()) < 3 * (z * clip / m) / math.sqrt(noise.size)
    # the same seed draws the same noise for numpy and torch tensors; another seed does not
    results = []
    for tensors, seed in ((reference, 7), ({n: torch.from_numpy(v) for n, v in reference.items()}, 7), (reference, 8)):
        dp = rule(tensors, clip=clip, z=z, m=m, seed=seed)
        dp.add(tensors, 1)
        results.append({n: np.asarray(v) for n, v in dp.result().items()})
    np.testing.assert_array_equal(results[0]["w"], results[1]["w"])
    assert not np.array_equal(results[0]["w"], results[2]["w"])


def test_batchnorm_statistics_are_not_aggregated_nor_clipped() -> None:
    """Non-private shared tensors (running statistics) come back as the round model's and do not count in the norm."""
    rng = np.random.default_rng(4)
    reference = {**model(rng), "bn.running_var": np.ones(8, np.float32)}
    trained = update_of_norm({n: reference[n] for n in SHAPES}, 0.5, rng)
    update = {**trained, "bn.running_var": np.full(8, 900, np.float32)}
    dp = rule(reference, clip=1.0, private_names=list(SHAPES))
    assert dp.add(update, 3) == pytest.approx(0.5, rel=1e-5)
    released = dp.result()
    np.testing.assert_array_equal(released["bn.running_var"], reference["bn.running_var"])
    np.testing.assert_array_equal(released["fc.weight"], update["fc.weight"])


def test_private_tensors_of_a_real_fedper_model_are_the_trainable_base() -> None:
    """MobileNet-v1 with K_P=2: DP covers the base's parameters; the head is never shared and the base's
    BatchNorm statistics are shared but left out (released as the round model's)."""
    net = build_model("mobilenet_v1", num_classes=4, width=0.25)
    manifest = describe(net, architecture="mobilenet_v1", kp=2, algorithm="fedper", input_size=32)
    private = private_tensor_names(manifest)
    shared = manifest.names(shared=True)
    assert private and set(private) < set(shared)
    assert not set(private) & set(manifest.names("head"))
    left_out = set(shared) - set(private)
    assert left_out and all(name.endswith(("running_mean", "running_var")) for name in left_out)
    reference = {name: value.numpy() for name, value in exported_state(net).items() if name in shared}
    update = {name: value + np.float32(0.01) for name, value in reference.items()}
    dp = rule(reference, clip=0.5, z=1.0, m=1.0, private_names=private)
    dp.add(update, 8)
    released = dp.result()
    for name in left_out:
        np.testing.assert_array_equal(released[name], reference[name])
    assert not np.array_equal(released[private[0]], reference[private[0]])


def test_one_device_moves_the_mean_by_at_most_c_over_m_whatever_its_claim() -> None:
    """The sensitivity bound that z*C/m noise relies on: capped weights and a fixed denominator."""
    rng = np.random.default_rng(5)
    reference = model(rng)
    honest = [(update_of_norm(reference, 5.0, rng), 100) for _ in range(4)]
    outlier = (update_of_norm(reference, 1e4, rng), 10**9)  # a huge update claiming a billion samples
    means = []
    for updates in (honest, [*honest, outlier]):
        dp = rule(reference, clip=2.0, m=5.0, sample_cap=100.0)
        for tensors, n in updates:
            dp.add(tensors, n)
        means.append(dp.result(np.float64))
    assert delta_norm(means[1], means[0], SHAPES) <= 2.0 / 5.0 + 1e-9
    # FedPer's n_j / sum n_j weights of the same clipped deltas, by contrast, let that device move the mean by ~C
    weighted = []
    for updates in (honest, [*honest, outlier]):
        mean = WeightedMean()
        for tensors, n in updates:
            mean.add(clip_delta(tensors, reference, 2.0, SHAPES), n)
        weighted.append(mean.result())
    assert delta_norm(weighted[1], weighted[0], SHAPES) > 1.9
    assert expected_weight([50, 100, 1e9], 0.5, sample_cap=100) == pytest.approx(0.5 * 2.5)
    assert expected_weight([1, 2, 3, 4], 0.5) == 2.0


def test_refused_update_leaves_the_rule_unchanged() -> None:
    rng = np.random.default_rng(6)
    reference = model(rng)
    dp = rule(reference)
    dp.add(update_of_norm(reference, 0.5, rng), 1)
    bad = update_of_norm(reference, 0.5, rng)
    bad["conv.bias"][0] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        dp.add(bad, 1)
    with pytest.raises(ValueError, match="layout"):
        dp.add({n: v for n, v in bad.items() if n != "fc.weight"}, 1)
    with pytest.raises(ValueError, match="sample count"):
        dp.add(update_of_norm(reference, 0.5, rng), 0)
    assert (dp.count, dp.unclipped, dp.total_weight) == (1, 1, 1.0)
    assert all(np.isfinite(v).all() for v in dp.sums().values())


def test_checkpoint_and_resume_give_the_same_noised_model() -> None:
    """A restart between two updates (sums and JSON meta saved, generator re-derived) releases the same model."""
    rng = np.random.default_rng(9)
    reference = model(rng)
    updates = [update_of_norm(reference, norm, rng) for norm in (0.2, 3.0, 0.9)]
    whole = DPFedAvg(reference, clip_norm=1.0, noise_multiplier=1.1, expected_weight=3.0, rng=round_generator(42, 7))
    first = DPFedAvg(reference, clip_norm=1.0, noise_multiplier=1.1, expected_weight=3.0, rng=round_generator(42, 7))
    for u in updates:
        whole.add(u, 10)
    for u in updates[:2]:
        first.add(u, 10)
    meta = json.loads(json.dumps(first.meta()))
    sums = {n: v.copy() for n, v in first.sums().items()}
    resumed = DPFedAvg.resume(reference, sums, meta, round_generator(42, 7))
    resumed.add(updates[2], 10)
    assert (resumed.count, resumed.unclipped) == (3, 2)
    expected, got = whole.result(), resumed.result()
    for name in SHAPES:
        np.testing.assert_array_equal(got[name], expected[name])
    with pytest.raises(ValueError, match="float64"):
        DPFedAvg.resume(reference, {n: v.astype(np.float32) for n, v in sums.items()}, meta, round_generator(42, 7))


def test_round_generator_is_per_round_and_reproducible() -> None:
    assert round_generator(123, 4).standard_normal() == round_generator(123, 4).standard_normal()
    assert round_generator(123, 4).standard_normal() != round_generator(123, 5).standard_normal()


# ---------------------------------------------------------------- adaptive clipping


@pytest.mark.parametrize("start", [0.05, 20.0])
def test_adaptive_clipping_moves_c_to_the_target_quantile(start: float) -> None:
    """Update norms log-normal around 1: C starts 20x off and ends near their median, through the rule."""
    rng = np.random.default_rng(10)
    reference = {"w": np.zeros(16, np.float32)}
    adaptive = AdaptiveClipping(clip_norm=start, target_quantile=0.5, learning_rate=0.2, count_noise_std=40 / 20)
    devices = 40
    for round_index in range(80):
        dp = rule(reference, clip=adaptive.clip_norm, z=adaptive.update_noise_multiplier(1.0), m=devices,
                  seed=round_index)
        for norm in np.exp(rng.normal(0.0, 0.5, devices)):
            dp.add(update_of_norm(reference, float(norm), rng), 1)
        adaptive.step(dp.unclipped, dp.count, devices, rng)
    assert adaptive.clip_norm == pytest.approx(1.0, rel=0.25)  # the median of exp(N(0, 0.5^2)) is 1
    restored = AdaptiveClipping.from_json(adaptive.to_json())
    assert restored == adaptive


def _noisy_fraction(unclipped: int, folded: int, m: int, count_std: float, seed: int) -> float:
    """The fraction `step` used, read back from the clip norm it moved to: with learning rate 1 and target 0,
    C' = C * exp(-fraction)."""
    clipping = AdaptiveClipping(clip_norm=1.0, target_quantile=0.0, learning_rate=1.0, count_noise_std=count_std)
    return -math.log(clipping.step(unclipped, folded, m, np.random.default_rng(seed)))


def test_adaptive_clipping_epsilon_is_that_of_the_mechanism_it_runs() -> None:
    """Issue 26: 10 devices, all every round, z = 1, 50 rounds. The released queries are measured from the
    code's outputs (not its formula): the sum's noise multiplier (noise std over the clip norm, its add/remove
    sensitivity) and the count's noise over how far one device more moves it. dp-accounting then composes
    the two Gaussian mechanisms as separate events, and the accountant's epsilon for z must be that.
    With a 0/1 bit (sensitivity 1, the bug) the same composition gives the issue's 86.7, not 57.3."""
    m, z, rounds = 10, 1.0, 50
    clipping = AdaptiveClipping(clip_norm=1.0)
    release = rule({"w": np.zeros(4, np.float32)}, clip=1.0, z=z, m=1.0)
    release.add({"w": np.ones(4, np.float32)}, 1)
    prepare_release(release, m, z, clipping)
    sum_multiplier = release.noise_std * release.expected_weight / release.clip_norm
    count_std = clipping.count_noise_std
    base = _noisy_fraction(5, 10, m, count_std, seed=3)
    assert 0 < base < 1 and base - 0.5 == pytest.approx(np.random.default_rng(3).normal(0, count_std) / m)
    moves = [abs(_noisy_fraction(5 + bit, 11, m, count_std, seed=3) - base) * m for bit in (0, 1)]
    assert moves == pytest.approx([0.5, 0.5])  # one device more moves the count by 1/2, clipped or not
    # replace-one (sampling "fixed"): one device's bit flipped moves it by 1, twice 1/2, as the sum's 2C is
    # twice C, so the pair is still one Gaussian, at half the multiplier: what dp_event's z / 2 accounts
    assert abs(_noisy_fraction(6, 10, m, count_std, seed=3) - base) * m == pytest.approx(1.0)

    def true_epsilon(count_sensitivity: float) -> float:
        accountant = rdp.RdpAccountant()
        accountant.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.ComposedDpEvent([
            dp_accounting.GaussianDpEvent(sum_multiplier),
            dp_accounting.GaussianDpEvent(count_std / count_sensitivity)]), rounds))
        return accountant.get_epsilon(1e-5)

    reported = PrivacyAccountant(1e-5, history=[(rounds, 1.0, z)]).epsilon()
    assert reported == pytest.approx(true_epsilon(max(moves)), rel=1e-6)
    assert round(reported, 1) == 57.3 and round(true_epsilon(1.0), 1) == 86.7


def test_adaptive_clipping_clamps_the_fraction_and_checks_the_count() -> None:
    assert _noisy_fraction(0, 10, 10, 1e-9, seed=0) == pytest.approx(0.0, abs=1e-9)
    assert _noisy_fraction(10, 10, 10, 50.0, seed=0) in (0.0, 1.0)  # noise 50 on a count of 10: clamped
    with pytest.raises(ValueError, match="unclipped"):
        AdaptiveClipping(clip_norm=1.0).step(3, 2, 10, np.random.default_rng(0))


# ---------------------------------------------------------------- accountant


def test_accountant_matches_the_published_dp_sgd_value() -> None:
    """TF Privacy's tutorials/README.md (github.com/tensorflow/privacy): compute_dp_sgd_privacy.py
    --N=60000 --batch_size=256 --noise_multiplier=1.1 --epochs=60 --delta=1e-5 gives eps = 3.01, with
    RDP's classic conversion eps = min_a rdp(a) + log(1/delta) / (a - 1) (Mironov 2017, Prop. 3).
    dp-accounting's RDP accountant converts with a tighter bound (Balle et al. 2020), so our epsilon is
    below 3.01, and PLD's tighter still."""
    q, steps = 256 / 60000, math.ceil(60 * 60000 / 256)
    accountant = PrivacyAccountant(delta=1e-5)
    accountant.record(q, 1.1, rounds=steps)
    curve = rdp.RdpAccountant()
    curve.compose(dp_event(accountant.history))
    classic = min(r + math.log(1 / 1e-5) / (a - 1) for a, r in zip(curve.orders, curve.rdp, strict=True) if a > 1)
    assert round(classic, 2) == 3.01
    library = rdp.RdpAccountant()
    library.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.1)), steps))
    eps = accountant.epsilon()
    assert eps == pytest.approx(library.get_epsilon(1e-5), rel=1e-12)
    assert 2.0 < eps < 3.01
    pld_eps = PrivacyAccountant(delta=1e-5, accounting="pld", history=accountant.history).epsilon()
    assert 2.0 < pld_eps < eps


def test_fixed_size_selection_is_accounted_without_replacement_at_its_replace_one_sensitivity() -> None:
    """Issue 26: 1,000 rounds inviting M = 10 of N = 1,000 (fedper.selection's fixed-size draw), z = 1.
    Replacing one device's update moves the clipped sum by 2C (measured on DPFedAvg below), so the event,
    written out by hand for dp-accounting's REPLACE_ONE RDP accountant, is sampling without replacement of
    the Gaussian mechanism at multiplier z C / 2C. Poisson sampling at q = 0.01 would report 2.1."""
    reference = {"w": np.zeros(3, np.float32)}
    sums = []
    for sign in (1, -1):
        one = rule(reference, clip=1.0)
        one.add({"w": np.array([5 * sign, 0, 0], np.float32)}, 1)
        sums.append(one.sums()["w"])
    sensitivity = float(np.linalg.norm(sums[0] - sums[1]))
    assert sensitivity == pytest.approx(2.0)
    library = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    library.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.SampledWithoutReplacementDpEvent(
        1000, 10, dp_accounting.GaussianDpEvent(1.0 / sensitivity)), 1000))
    fixed = PrivacyAccountant(1e-5, history=[(1000, 10 / 1000, 1.0)], sampling="fixed")
    assert fixed.epsilon() == pytest.approx(library.get_epsilon(1e-5), rel=1e-9)
    poisson = PrivacyAccountant(1e-5, history=[(1000, 0.01, 1.0)]).epsilon()
    assert round(poisson, 1) == 2.1 and fixed.epsilon() > 9 * poisson
    assert PrivacyAccountant.from_json(fixed.to_json()) == fixed
    old = json.loads(fixed.to_json())
    del old["sampling"]  # a checkpoint written before the field: it was accounted as Poisson
    assert PrivacyAccountant.from_json(json.dumps(old)).sampling == "poisson"
    with pytest.raises(ValueError, match="PLD"):
        PrivacyAccountant(1e-5, accounting="pld", sampling="fixed")
    z = noise_multiplier_for(5.0, 1e-5, 0.01, 100, sampling="fixed")
    assert PrivacyAccountant(1e-5, history=[(100, 0.01, z)], sampling="fixed").epsilon() <= 5.0
    assert PrivacyAccountant(1e-5, history=[(100, 0.01, z - 0.01)], sampling="fixed").epsilon() > 5.0


@pytest.mark.parametrize("sampling", ["fixed", "poisson"])
def test_epsilon_of_a_long_mixed_history_is_the_librarys_and_each_distinct_round_is_computed_once(
        sampling: str) -> None:
    """The coordinator asks for epsilon twice a round; the RDP of each distinct (q, z) round is kept, so a run's
    epsilon is the sum of its segments' curves: equal to dp-accounting composing the whole history afresh, and
    asking again (or after more rounds of a kept (q, z)) computes no curve."""
    from fedper import privacy

    relation = dp_accounting.NeighboringRelation.REPLACE_ONE if sampling == "fixed" else \
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    accountant = PrivacyAccountant(1e-5, sampling=sampling)
    for i in range(12):  # the fleet grows and shrinks: q = 8 / N for N among 24, 25, 26, and z changes once
        accountant.record(8 / (24 + i % 3), 0.9 if i < 9 else 1.3)
    library = rdp.RdpAccountant(neighboring_relation=relation)
    library.compose(dp_event(accountant.history, sampling))
    assert accountant.epsilon() == pytest.approx(library.get_epsilon(1e-5), rel=1e-12)
    computed = privacy._rdp_of_one_round.cache_info().misses
    accountant.record(8 / 25, 1.3, rounds=100)
    assert accountant.epsilon() > library.get_epsilon(1e-5)
    assert accountant.projected_epsilon(8 / 24, 1.3) > accountant.epsilon()
    assert privacy._rdp_of_one_round.cache_info().misses == computed


def test_a_restored_accountant_computes_no_round_of_its_history_again() -> None:
    """Issue 39's 30-minute dp soak: under churn q = M / N changed nearly every round (about 40 distinct rounds,
    up to a second each on one core, far more under load), and a coordinator restarted after each SIGKILL
    computed all of them again before it could close a round: 2.7 rounds a minute under faults against 73
    without. The checkpoint keeps the history's Rényi DP, so a restored accountant computes nothing it already
    had, and agrees with one that composes the history afresh; a checkpoint written before it (no "rdp")
    still restores, computing it once."""
    from fedper import privacy

    accountant = PrivacyAccountant(1e-5, sampling="fixed")
    for n in range(17, 24):
        accountant.record(6 / n, 0.9)
    fresh = accountant.epsilon()
    library = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    library.compose(dp_event(accountant.history, "fixed"))  # dp-accounting composing the history itself
    assert fresh == pytest.approx(library.get_epsilon(1e-5), rel=1e-12)
    privacy._rdp_of_one_round.cache_clear()
    restored = PrivacyAccountant.from_json(accountant.to_json())
    assert restored.epsilon() == pytest.approx(fresh, rel=1e-12)
    assert privacy._rdp_of_one_round.cache_info().misses == 0
    restored.record(6 / 23, 0.9)  # the next round: its own curve, not the history's 7
    assert privacy._rdp_of_one_round.cache_info().misses == 1
    assert restored.projected_epsilon(6 / 11, 0.9) == pytest.approx(
        PrivacyAccountant(1e-5, history=[*restored.history, (1, 6 / 11, 0.9)], sampling="fixed").epsilon(), rel=1e-12)
    before = json.loads(accountant.to_json())
    del before["rdp"]
    assert PrivacyAccountant.from_json(json.dumps(before)).epsilon() == pytest.approx(fresh, rel=1e-12)
    orders = len(accountant.rdp)
    for bad in ([1.0] * 3, [-1.0] * orders, [math.inf] * orders):
        with pytest.raises(ValueError, match="rdp must be"):
            PrivacyAccountant.from_json(json.dumps({**before, "rdp": bad}))
    with pytest.raises(ValueError, match="rdp must be"):  # a noiseless round has no finite Rényi DP
        PrivacyAccountant(1e-5, history=[(1, 0.5, 0.0)], rdp=accountant.rdp)
    edited = json.loads(accountant.to_json())  # a history edited by hand: the kept sum is another history's
    edited["history"].append([5, 0.5, 0.9])
    library.compose(dp_accounting.SelfComposedDpEvent(  # 1 device of 2, replace-one: the sum moves by 2C, so z / 2
        dp_accounting.SampledWithoutReplacementDpEvent(2, 1, dp_accounting.GaussianDpEvent(0.9 / 2)), 5))
    assert PrivacyAccountant.from_json(json.dumps(edited)).epsilon() == pytest.approx(library.get_epsilon(1e-5),
                                                                                       rel=1e-12)


def test_a_device_whose_rounds_are_known_gets_no_subsampling_discount() -> None:
    """Issue 26: with a public seed, a device's 10 rounds of those 1,000 are known: its epsilon is that of 10
    unsampled Gaussian rounds, about 19. Hand bound: Gaussian RDP 10 * a / (2 z^2) with the classic
    conversion min_a rdp(a) + log(1/delta) / (a - 1) (Mironov 2017), which dp-accounting tightens."""
    known = PrivacyAccountant(1e-5, history=[(10, 1.0, 1.0)]).epsilon()
    hand = min(10 * a / 2 + math.log(1e5) / (a - 1) for a in np.linspace(1.01, 20, 4000))
    assert round(known) == 19 and known < hand < 1.1 * known


def test_epsilon_grows_with_rounds_and_falls_with_noise() -> None:
    by_rounds = [PrivacyAccountant(1e-5, history=[(k, 0.01, 1.0)]).epsilon() for k in (1, 10, 100, 1000)]
    assert by_rounds == sorted(by_rounds) and len(set(by_rounds)) == 4
    by_noise = [PrivacyAccountant(1e-5, history=[(100, 0.01, z)]).epsilon() for z in (0.7, 1.0, 2.0, 4.0)]
    assert by_noise == sorted(by_noise, reverse=True) and len(set(by_noise)) == 4
    assert PrivacyAccountant(1e-5).epsilon() == 0.0
    assert PrivacyAccountant(1e-5, history=[(1, 0.1, 0.0)]).epsilon() == math.inf


def test_noise_multiplier_for_a_budget_meets_it_and_no_less_would() -> None:
    z = noise_multiplier_for(2.0, 1e-5, 0.02, 200)
    assert PrivacyAccountant(1e-5, history=[(200, 0.02, z)]).epsilon() <= 2.0
    assert PrivacyAccountant(1e-5, history=[(200, 0.02, z - 0.01)]).epsilon() > 2.0


def test_accountant_state_round_trips_through_json() -> None:
    accountant = PrivacyAccountant(delta=1e-6)
    for _ in range(5):
        accountant.record(0.02, 1.2)
    accountant.record(0.05, 1.2, rounds=3)
    assert accountant.history == [(5, 0.02, 1.2), (3, 0.05, 1.2)] and accountant.rounds == 8
    projected = accountant.projected_epsilon(0.05, 1.2)
    restored = PrivacyAccountant.from_json(json.loads(json.dumps(accountant.to_json())))
    assert restored == accountant
    assert restored.epsilon() == accountant.epsilon() < projected
    restored.record(0.05, 1.2)
    assert restored.epsilon() == pytest.approx(projected, rel=1e-12)
    with pytest.raises(ValueError, match="sampling rate"):
        accountant.record(1.5, 1.0)


def test_budget_action() -> None:
    assert budget_action(2.0, None, "stop") == "continue"
    assert budget_action(2.0, 3.0, "stop") == "continue"
    assert budget_action(3.5, 3.0, "stop") == "stop"
    assert budget_action(3.5, 3.0, "warn") == "warn"
    with pytest.raises(ValueError):
        budget_action(1.0, 3.0, "ignore")  # type: ignore[arg-type]
