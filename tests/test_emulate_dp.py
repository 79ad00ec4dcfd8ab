"""Differential privacy in the emulator: the coordinator's DP-FedAvg and accountant (fedper.privacy) on an
emulated fleet, epsilon per round, the budget, resume, and figure dp."""

from __future__ import annotations

import dataclasses
import json
import math

import dp_accounting
import pytest
import torch
from dp_accounting import rdp
from test_emulate import TINY, digits_config, synthetic
from typer.testing import CliRunner

from fedper.emulate.cli import app
from fedper.emulate.experiment import STATE, RunConfig, run_experiment
from fedper.emulate.fleet import Fleet, FleetConfig, load_state, noise_secret
from fedper.privacy import DPFedAvg, PrivacyAccountant, private_tensor_names, round_generator

DP = {"clip_norm": 0.5, "dp_noise_multiplier": 1.0}


def trained_updates(fleet: Fleet, state, clients: list[int]) -> list[dict[str, torch.Tensor]]:
    """The shared tensors each client sends after its local training from `state` (the fleet's own trainer)."""
    return [{n: t.clone() for n, t in shared.items()} for shared, _ in fleet._train(state, clients)]


def test_the_dp_aggregate_is_privacys_dpfedavg_on_the_same_updates_and_seed():
    """One round: the released model equals fedper.privacy.DPFedAvg fed the same client updates, with the
    round's generator (round_generator(noise_secret(seed), 1)) and M as the denominator, bit for bit."""
    data = synthetic([12, 20, 16])
    fleet = Fleet(FleetConfig(algorithm="fedper", kp=1, seed=3, **TINY, **DP), data)
    start = fleet.init()
    updates = trained_updates(fleet, start, [0, 1, 2])
    new, metrics = fleet.run_round(start)

    rule = DPFedAvg(start.shared, clip_norm=0.5, noise_multiplier=1.0, expected_weight=3.0,
                    rng=round_generator(noise_secret(3), 1), private_names=private_tensor_names(fleet.manifest))
    for j, update in enumerate(updates):
        rule.add(update, data.n_train[j])
    wanted = rule.result()
    assert list(new.shared) == list(wanted)
    for name in wanted:
        assert torch.equal(new.shared[name], wanted[name]), name

    private = set(private_tensor_names(fleet.manifest))
    statistics = [n for n in new.shared if n not in private]
    assert statistics, "the model has shared BatchNorm statistics"
    assert all(torch.equal(new.shared[n], start.shared[n]) for n in statistics)  # not aggregated under DP
    noiseless = DPFedAvg(start.shared, clip_norm=0.5, noise_multiplier=0.0, expected_weight=3.0,
                         rng=round_generator(0, 1), private_names=sorted(private))
    for j, update in enumerate(updates):
        noiseless.add(update, data.n_train[j])
    name = "stem.0.weight"
    noise = (new.shared[name].double() - noiseless.result()[name].double()).flatten()
    assert noise.std().item() == pytest.approx(1.0 * 0.5 / 3, rel=0.15)  # z * C / M on every coordinate
    dp = metrics["dp"]
    assert dp["noise_std"] == pytest.approx(0.5 / 3) and dp["expected_participants"] == 3
    assert dp["sampling_rate"] == 1.0 and dp["clip_norm"] == 0.5 and 0 <= dp["unclipped"] <= 3


def test_epsilon_grows_each_round_as_sampling_two_of_four_without_replacement():
    """Two of four clients a round, drawn without replacement as the coordinator draws them: each round's
    epsilon is that of k such rounds written out for dp-accounting's replace-one RDP accountant (the clipped
    sum moves by up to 2C when one client's data is replaced, so the Gaussian's multiplier is z / 2)."""
    data = synthetic([10, 10, 10, 10])
    fleet = Fleet(FleetConfig(algorithm="fedper", kp=1, clients_per_round=2, dp_delta=1e-4, **TINY, **DP), data)
    state, epsilons = fleet.init(), []
    for _ in range(3):
        state, metrics = fleet.run_round(state)
        assert len(metrics["selected"]) == 2 and metrics["dp"]["sampling_rate"] == 0.5
        epsilons.append(metrics["dp"]["epsilon"])
    assert epsilons[0] < epsilons[1] < epsilons[2]
    for rounds, epsilon in enumerate(epsilons, start=1):
        library = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
        library.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.SampledWithoutReplacementDpEvent(4, 2, dp_accounting.GaussianDpEvent(1.0 / 2)), rounds))
        assert epsilon == pytest.approx(library.get_epsilon(1e-4), rel=1e-9)
    assert state.privacy is not None and state.privacy.accountant.history == [(3, 0.5, 1.0)]
    assert state.privacy.accountant.sampling == "fixed"


def test_without_noise_or_clipping_the_dp_rule_is_the_plain_mean():
    """z = 0 and a clip norm no update reaches: with equal client sizes (uniform weights = n_j weights) the
    trainable shared tensors are the plain run's mean; only the BatchNorm statistics stay the round model's,
    and epsilon is unbounded (null in metrics.jsonl)."""
    data = synthetic([16, 16, 16])
    plain = Fleet(FleetConfig(algorithm="fedper", kp=1, **TINY), data)
    private = Fleet(FleetConfig(algorithm="fedper", kp=1, clip_norm=1e6, dp_noise_multiplier=0.0, **TINY), data)
    (a, _), (b, metrics) = plain.run_round(plain.init()), private.run_round(private.init())
    names = private_tensor_names(private.manifest)
    moved = 0
    for name in names:
        assert torch.allclose(a.shared[name], b.shared[name], atol=1e-6, rtol=0), name
        moved += not torch.equal(b.shared[name], private.initial[name])
    assert moved == len(names)
    assert metrics["dp"]["epsilon"] is None and metrics["dp"]["unclipped"] == 3 and metrics["dp"]["noise_std"] == 0


def test_clip_norm_alone_bounds_each_update_as_the_coordinator_does():
    """--clip-norm without noise: the n_j-weighted mean of updates each within C of the round model, so the
    new model is within C of it too, where the plain run moved further."""
    data = synthetic([12, 20, 16])
    plain = Fleet(FleetConfig(algorithm="fedavg", kp=0, **TINY), data)
    clipped = Fleet(FleetConfig(algorithm="fedavg", kp=0, clip_norm=0.05, **TINY), data)
    start = plain.init()
    (a, _), (b, metrics) = plain.run_round(start), clipped.run_round(clipped.init())

    def distance(state) -> float:
        return math.sqrt(sum(float(((state.shared[n].double() - start.shared[n].double()) ** 2).sum())
                             for n in start.shared))

    assert distance(a) > 0.05 >= distance(b) - 1e-6
    assert "dp" not in metrics


def test_a_resumed_dp_run_equals_an_uninterrupted_one(tmp_path):
    """DP with adaptive clipping and two of three clients a round: three rounds in one go, and two then one
    more with --resume, give the same metrics (epsilon, clip norms), model, heads and accountant."""
    args = ["run", "--dataset", "digits", "--clients", "3", "--classes-per-client", "3", "--input-size", "16",
            "--width", "0.25", "--local-epochs", "1", "--batch-size", "16", "--lr", "0.05", "--seed", "1",
            "--scale", "0.2", "--device", "cpu", "--no-progress", "--clients-per-round", "2",
            "--clip-norm", "1.0", "--dp-noise-multiplier", "0.8", "--dp-adaptive-clipping", "0.5"]
    runner = CliRunner()
    # --scale 0.2 shrinks the rounds too: 15 -> 3, 10 -> 2
    whole = runner.invoke(app, [*args, "--rounds", "15", "--out", str(tmp_path / "whole")])
    assert whole.exit_code == 0, whole.output
    assert "epsilon" in whole.output
    first = runner.invoke(app, [*args, "--rounds", "10", "--out", str(tmp_path / "split")])
    assert first.exit_code == 0, first.output
    resumed = runner.invoke(app, [*args, "--rounds", "15", "--out", str(tmp_path / "split"), "--resume"])
    assert resumed.exit_code == 0, resumed.output

    def lines(run: str) -> list[dict]:
        return [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    wanted, got = lines("whole"), lines("split")
    assert [m["round"] for m in got] == [1, 2, 3]
    strip = ("wall_s",)
    assert [{k: v for k, v in m.items() if k not in strip} for m in got] == [
        {k: v for k, v in m.items() if k not in strip} for m in wanted]
    clip_norms = [m["dp"]["clip_norm"] for m in wanted]
    assert clip_norms[1:] == [m["dp"]["next_clip_norm"] for m in wanted[:-1]] and clip_norms[0] == 1.0
    a, b = load_state(tmp_path / "whole" / STATE), load_state(tmp_path / "split" / STATE)
    assert a.round == b.round == 3
    assert all(torch.equal(a.shared[n], b.shared[n]) for n in a.shared)
    assert all(torch.equal(x[n], y[n]) for x, y in zip(a.local, b.local, strict=True) for n in x)
    assert a.privacy is not None and b.privacy is not None
    assert a.privacy.to_json() == b.privacy.to_json()
    assert a.privacy.accountant.rounds == 3 and a.privacy.clipping is not None
    summary = json.loads((tmp_path / "split" / "summary.json").read_text())
    assert summary["dp"]["epsilon"] == wanted[-1]["dp"]["epsilon"] and summary["dp"]["rounds_accounted"] == 3


def dp_config(rounds: int, **fleet) -> RunConfig:
    config = digits_config(rounds)
    return dataclasses.replace(config, fleet=dataclasses.replace(config.fleet, **DP, **fleet))


def test_the_budget_stops_a_run_before_the_round_that_would_exceed_it_and_a_resume_keeps_it_stopped(tmp_path):
    one, two = PrivacyAccountant(1e-5), PrivacyAccountant(1e-5)
    one.record(1.0, 1.0)
    two.record(1.0, 1.0, 2)
    target = (one.epsilon() + two.epsilon()) / 2  # round 1 fits, round 2 would not
    summary = run_experiment(dp_config(3, dp_target_epsilon=target), tmp_path / "stop", show_progress=False)
    assert summary["rounds"] == 1 and summary["dp"]["budget_stopped"] is True
    assert summary["dp"]["epsilon"] == pytest.approx(one.epsilon()) and one.epsilon() <= target
    again = run_experiment(dp_config(5, dp_target_epsilon=target), tmp_path / "stop", resume=True,
                           show_progress=False)
    assert again["rounds"] == 1 and again["dp"]["budget_stopped"] is True

    warned = run_experiment(dp_config(2, dp_target_epsilon=target, dp_budget_action="warn"), tmp_path / "warn",
                            show_progress=False)
    assert warned["rounds"] == 2 and warned["dp"]["budget_stopped"] is False
    assert warned["dp"]["epsilon"] == pytest.approx(two.epsilon()) and two.epsilon() > target

    with pytest.raises(ValueError, match=r"one round at q 1 and noise multiplier 1\.0 already spends more"):
        run_experiment(dp_config(2, dp_target_epsilon=one.epsilon() / 2), tmp_path / "never", show_progress=False)


@pytest.mark.parametrize(("flags", "message"), [
    (["--dp-noise-multiplier", "1"], "needs --clip-norm > 0"),
    (["--dp-target-epsilon", "3"], "need --dp-noise-multiplier"),
    (["--dp-noise-multiplier", "1", "--clip-norm", "1", "--dp-budget-action", "halt"], "stop or warn"),
    (["--dp-noise-multiplier", "1", "--clip-norm", "1", "--world-size", "2"], "runs in one process"),
])
def test_inconsistent_dp_flags_are_refused_in_one_line(tmp_path, flags, message):
    result = CliRunner().invoke(app, ["run", "--dataset", "digits", "--clients", "2", "--input-size", "8",
                                      "--width", "0.25", "--rounds", "1", "--scale", "0.2", "--device", "cpu",
                                      "--no-progress", "--out", str(tmp_path / "x"), *flags])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_figure_dp_draws_accuracy_against_epsilon_for_fedavg_and_fedper(tmp_path):
    from fedper.emulate.figures import NOISE_MULTIPLIERS, make_figure

    # --scale 0.2 keeps 2 of the 10 rounds
    png = make_figure("dp", out=tmp_path, dataset="digits", rounds=10, scale=0.2, show_progress=False,
                      fleet_overrides={"width": 0.25, "local_epochs": 1, "batch_size": 16, "clip_norm": 0.5},
                      data_overrides={"clients": 2, "classes_per_client": 2, "input_size": 8})
    assert png == tmp_path / "dp.png" and png.stat().st_size > 1000
    configs = [RunConfig.from_json(p.read_text()) for p in sorted((tmp_path / "dp").glob("*/config.json"))]
    assert len(configs) == 10 and {(c.fleet.algorithm, c.fleet.dp_noise_multiplier) for c in configs} == {
        (a, z) for a in ("fedavg", "fedper") for z in (None, *NOISE_MULTIPLIERS)}
    for run in sorted((tmp_path / "dp").iterdir()):
        config = RunConfig.from_json((run / "config.json").read_text())
        metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert len(metrics) == 2
        if config.fleet.dp_noise_multiplier is None:
            assert config.fleet.clip_norm is None and "dp" not in metrics[-1]
        else:
            assert config.fleet.clip_norm == 0.5
            epsilon = metrics[-1]["dp"]["epsilon"]
            assert (epsilon is None) == (config.fleet.dp_noise_multiplier == 0)
