"""FedBABU's evaluation protocol and setting in the emulator: every algorithm fine-tuned before its
evaluation with the accuracy before it kept, the step-decayed learning rate, and figure babu's presets."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_emulate import run_rounds, synthetic

from fedper.emulate.data import DataConfig
from fedper.emulate.experiment import RunConfig
from fedper.emulate.figures import FLEET_DEFAULTS, default_rounds, fedbabu_schedule, make_figure
from fedper.emulate.fleet import Fleet, FleetConfig

TINY = {"width": 0.25, "local_epochs": 1, "batch_size": 8, "lr": 0.05}


def test_the_lr_follows_its_milestones_and_survives_config_json() -> None:
    config = FleetConfig(lr=0.1, lr_milestones=(4, 6), lr_decay=0.1)
    assert [config.lr_at(r) for r in (1, 4, 5, 6, 7)] == pytest.approx([0.1, 0.1, 0.01, 0.01, 0.001])
    run = RunConfig(DataConfig(), config)
    assert RunConfig.from_json(run.to_json()) == run  # a list in config.json, a tuple again: --resume matches

    data = synthetic([16, 12])
    frozen_after_1 = Fleet(FleetConfig(algorithm="fedper", kp=2, lr_milestones=(1,), lr_decay=0.0, **TINY), data)
    state, history = run_rounds(frozen_after_1, 2)
    assert [m["lr"] for m in history] == [0.05, 0.0]
    after_1, _ = run_rounds(frozen_after_1, 1)
    weights = [t.name for t in frozen_after_1.manifest.tensors if t.trainable and t.shared]
    assert all(torch.equal(state.shared[n], after_1.shared[n]) for n in weights)  # round 2 trained at lr 0
    assert not all(torch.equal(after_1.shared[n], frozen_after_1.initial[n]) for n in weights)


def test_every_algorithm_is_fine_tuned_before_evaluation_and_both_accuracies_are_kept() -> None:
    """The fine-tune works on a copy: the run's state and its untuned accuracy are those of a run that does
    not fine-tune, bit for bit; `accuracy` is the fine-tuned copy's, `initial_accuracy` the model's before."""
    data = synthetic([16, 12, 20])
    plain = Fleet(FleetConfig(algorithm="fedper", kp=2, **TINY), data)
    tuned = Fleet(FleetConfig(algorithm="fedper", kp=2, eval_finetune_every_algorithm=True, eval_finetune_epochs=2,
                              eval_finetune_interval=2, **TINY), data)
    (a, ma), (b, mb) = run_rounds(plain, 2), run_rounds(tuned, 2)
    assert all(torch.equal(a.shared[n], b.shared[n]) for n in a.shared)
    assert "initial_accuracy" not in ma[0]
    assert [m["initial_accuracy"] for m in mb] == [m["accuracy"] for m in ma]
    assert [m["finetuned"] for m in mb] == [False, True]  # only the rounds that are multiples of the interval
    assert mb[0]["accuracy"] == mb[0]["initial_accuracy"]
    assert mb[1]["initial_loss"] != mb[1]["loss"]
    assert mb[1]["mean_initial_accuracy"] == pytest.approx(sum(ma[1]["accuracy"]) / 3)

    fedbabu = Fleet(FleetConfig(algorithm="fedbabu", kp=1, **TINY), data)  # FedBABU fine-tunes without the flag
    _, history = run_rounds(fedbabu, 1)
    assert history[0]["finetuned"] and len(history[0]["initial_accuracy"]) == 3


def test_fedbabus_schedule_over_the_runs_rounds() -> None:
    babu = FleetConfig(**FLEET_DEFAULTS["babu"])
    assert (babu.lr, babu.momentum, babu.batch_size, babu.eval_finetune_epochs) == (0.1, 0.9, 50, 5)
    assert babu.eval_finetune_every_algorithm
    assert [default_rounds("babu", dataclasses.replace(babu, local_epochs=e)) for e in (1, 4, 10)] == [320, 80, 32]
    assert default_rounds("fig2", babu) == 100
    scheduled = fedbabu_schedule(babu, 80)
    assert (scheduled.lr_milestones, scheduled.eval_finetune_interval) == ((40, 60), 10)
    assert [scheduled.lr_at(r) for r in (40, 41, 60, 61, 80)] == pytest.approx([0.1, 0.01, 0.01, 0.001, 0.001])
    assert fedbabu_schedule(babu, 3).eval_finetune_interval == 1
    assert fedbabu_schedule(dataclasses.replace(babu, lr_milestones=(5,)), 80).lr_milestones == (5,)


@pytest.mark.long
def test_figure_babu_runs_fedbabus_setting_and_draws_both_accuracies(tmp_path) -> None:
    png = make_figure("babu", out=tmp_path, dataset="digits", rounds=32, scale=0.125, show_progress=False,
                      fleet_overrides={"width": 0.25, "local_epochs": 1, "batch_size": 16, "eval_finetune_epochs": 1},
                      data_overrides={"clients": 5, "shards": 2, "input_size": 8})
    assert png.name == "babu-s2.png" and png.stat().st_size > 1000
    runs = sorted((tmp_path / "babu").iterdir())
    assert runs and all("-s2-" in r.name for r in runs)
    configs = [RunConfig.from_json((run / "config.json").read_text()) for run in runs]
    # 5 clients x 2 shards for every curve; f = 0.1 trains max(1, round(0.5)) = 1 client a round, f = 1.0 all 5
    assert [(c.data.clients, c.data.partition, c.data.shards) for c in configs] == [(5, "shards", 2)] * 11
    assert sorted(c.fleet.clients_per_round for c in configs) == [1] * 5 + [5] * 6
    for run, config in zip(runs, configs, strict=True):
        f = config.fleet
        assert (f.lr, f.momentum, f.lr_milestones, f.eval_finetune_every_algorithm) == (0.1, 0.9, (2, 3), True)
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [m["lr"] for m in metrics] == pytest.approx([0.1, 0.1, 0.01, 0.001])
        assert all(m["finetuned"] and len(m["initial_accuracy"]) == 5 for m in metrics)
        assert [len(m["selected"]) for m in metrics] == [f.clients_per_round] * 4
        assert [len(m["accuracy"]) for m in metrics] == [5] * 4


def test_a_head_fine_tune_of_a_model_without_a_head_is_refused() -> None:
    """FedAvg (K_P = 0) has no head: fine-tuning "head" before evaluation would train nothing."""
    with pytest.raises(ValueError, match="no such tensors to fine-tune"):
        Fleet(FleetConfig(algorithm="fedavg", kp=0, eval_finetune="head", eval_finetune_every_algorithm=True, **TINY),
              synthetic([8, 8]))
    Fleet(FleetConfig(algorithm="fedavg", kp=0, eval_finetune="all", eval_finetune_every_algorithm=True, **TINY),
          synthetic([8, 8]))
