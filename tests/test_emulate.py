"""The emulated fleet: aggregation, personalization, evaluation, resume and the batched engine."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from fedper.algorithms import ALGORITHMS
from fedper.batches import PURPOSE_TRAIN
from fedper.emulate.batched import evaluate_clients_batched
from fedper.emulate.cli import app
from fedper.emulate.data import DataConfig, FleetData
from fedper.emulate.experiment import STATE, RunConfig, run_experiment
from fedper.emulate.fleet import Fleet, FleetConfig, load_state
from fedper.emulate.train import client_generator, train_client
from fedper.models import build_model
from fedper.training import load_tensors

TINY = {"width": 0.25, "local_epochs": 1, "batch_size": 8, "lr": 0.05}


def synthetic(sizes: list[int], classes: int = 4, side: int = 16, seed: int = 0) -> FleetData:
    """Learnable images: each class has its own mean pattern; client j gets sizes[j] train and 8 test samples."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(classes, 3, side, side, generator=g)
    n = sum(sizes) + 8 * len(sizes)
    y = torch.randint(0, classes, (n,), generator=g)
    x = patterns[y] + 0.5 * torch.randn(n, 3, side, side, generator=g)
    clients, start = [], 0
    for size in sizes:
        clients.append((torch.arange(start, start + size), torch.arange(start + size, start + size + 8)))
        start += size + 8
    return FleetData(x=x, y=y, clients=clients, classes=[str(c) for c in range(classes)])


def run_rounds(fleet: Fleet, rounds: int):
    state, history = fleet.init(), []
    for _ in range(rounds):
        state, metrics = fleet.run_round(state)
        history.append(metrics)
    return state, history


def test_fedavg_equals_fedper_at_kp0_bit_for_bit():
    data = synthetic([24, 16, 20])
    fedavg = Fleet(FleetConfig(algorithm="fedavg", kp=0, **TINY), data)
    fedper0 = Fleet(FleetConfig(algorithm="fedper", kp=0, **TINY), data,
                    algorithm=dataclasses.replace(ALGORITHMS["fedper"], requires_kp0=True))
    assert fedper0.local_names == [] and fedavg.shared_names == fedper0.shared_names
    (a, ma), (b, mb) = run_rounds(fedavg, 2), run_rounds(fedper0, 2)
    for name in a.shared:
        assert torch.equal(a.shared[name], b.shared[name]), name
    assert [m["accuracy"] for m in ma] == [m["accuracy"] for m in mb]
    assert [m["loss"] for m in ma] == [m["loss"] for m in mb]


def test_aggregation_weights_are_training_sample_counts():
    sizes = [8, 40, 17]
    data = synthetic(sizes)
    fleet = Fleet(FleetConfig(algorithm="fedper", kp=1, **TINY), data)
    start = fleet.init()
    new, _ = fleet.run_round(start)
    trained = []  # each client's training redone by hand, from the same start and batches
    model = build_model("mobilenet_v1", 4, 0.25, 16)
    for j, (train_idx, _) in enumerate(data.clients):
        load_tensors(model, start.shared, start.local[j])
        train_client(model, fleet.manifest, ALGORITHMS["fedper"].phases, data.x, data.y, train_idx,
                     local_epochs=1, batch_size=8, lr=0.05, momentum=0.0,
                     generator=client_generator(0, 0, j, PURPOSE_TRAIN))
        trained.append({n: t.double() for n, t in model.state_dict().items() if n in start.shared})
    name = "stem.0.weight"
    weighted = sum(n * t[name] for n, t in zip(sizes, trained, strict=True)) / sum(sizes)
    plain = sum(t[name] for t in trained) / len(trained)
    assert torch.allclose(new.shared[name].double(), weighted, atol=1e-6)
    assert not torch.allclose(new.shared[name].double(), plain, atol=1e-4)
    for n in new.shared:
        hand = sum(s * t[n] for s, t in zip(sizes, trained, strict=True)) / sum(sizes)
        assert torch.allclose(new.shared[n].double(), hand, atol=1e-5), n


def test_a_clients_head_is_untouched_by_another_clients_training():
    data = synthetic([16, 16, 16])
    other = dataclasses.replace(data, y=data.y.clone())
    train_1 = data.clients[1][0]
    other.y[train_1] = (other.y[train_1] + 1) % 4  # client 1 learns something else
    heads = []
    for d in (data, other):
        fleet = Fleet(FleetConfig(algorithm="fedper", kp=2, **TINY), d)
        state, _ = fleet.run_round(fleet.init())
        heads.append(state.local)
    assert fleet.local_names and all(n.startswith(("classifier.", "blocks.12.")) for n in fleet.local_names)
    for n in fleet.local_names:
        assert torch.equal(heads[0][0][n], heads[1][0][n]), n  # client 0: identical
        assert torch.equal(heads[0][2][n], heads[1][2][n]), n  # client 2: identical
    assert any(not torch.equal(heads[0][1][n], heads[1][1][n]) for n in fleet.local_names)


def test_fedbabu_keeps_the_head_at_its_shared_initialization():
    data = synthetic([16, 12])
    fleet = Fleet(FleetConfig(algorithm="fedbabu", kp=1, **TINY), data)
    start = fleet.init()
    state, metrics = fleet.run_round(start)
    for j in range(2):  # at K_P=1 the head is the classifier alone: parameters, no BatchNorm statistics
        for n in fleet.local_names:
            assert torch.equal(state.local[j][n], start.local[0][n]), n
    assert any(not torch.equal(state.shared[n], start.shared[n]) for n in fleet.shared_names)
    assert len(metrics["accuracy"]) == 2


@pytest.mark.parametrize(("algorithm", "kp"), [("fedavg", 0), ("fedper", 2)])
def test_clients_are_evaluated_on_the_new_aggregate_plus_their_own_head(algorithm, kp):
    data = synthetic([16, 24, 20])
    fleet = Fleet(FleetConfig(algorithm=algorithm, kp=kp, **TINY), data)
    state, metrics = fleet.run_round(fleet.init())
    for j, (_, test_idx) in enumerate(data.clients):
        served = build_model("mobilenet_v1", 4, 0.25, 16)
        missing, unexpected = served.load_state_dict({**state.shared, **state.local[j]}, strict=False)
        assert not unexpected and all(m.endswith("num_batches_tracked") for m in missing)
        served.eval()
        with torch.no_grad():
            predicted = served(data.x[test_idx]).argmax(1)
        assert metrics["accuracy"][j] == pytest.approx(float((predicted == data.y[test_idx]).float().mean()))
    if algorithm == "fedavg":  # one global model: the same test set gives every client the same accuracy
        same = dataclasses.replace(data, clients=[(tr, data.clients[0][1]) for tr, _ in data.clients])
        _, m = Fleet(FleetConfig(algorithm="fedavg", kp=0, **TINY), same).run_round(fleet.init())
        assert len(set(m["accuracy"])) == 1 and len(set(m["loss"])) == 1


@pytest.mark.parametrize("algorithm", ["fedper", "fedrep"])
def test_vmap_engine_matches_the_sequential_one(algorithm):
    """In float64: a randomly initialized deep net amplifies float32 rounding to ~1e-3 in either engine.
    Even float64 rounding grows to ~6e-9 after two FedRep rounds (frozen BatchNorm layers normalize
    with batch statistics too, as on the devices), hence atol 1e-8; a wrong batch or step is >1e-3."""
    data = synthetic([17, 9, 24])  # unequal sizes: groups of clients change within an epoch
    data = dataclasses.replace(data, x=data.x.double())
    config = FleetConfig(algorithm=algorithm, kp=2, momentum=0.9, **TINY)
    sequential = Fleet(dataclasses.replace(config, engine="sequential"), data)
    batched = Fleet(dataclasses.replace(config, engine="vmap"), data)
    assert batched.engine == "vmap"
    for fleet in (sequential, batched):
        fleet.model.double()
        fleet.initial = {n: t.double() for n, t in fleet.initial.items()}
    (a, ma), (b, mb) = run_rounds(sequential, 2), run_rounds(batched, 2)
    for n in a.shared:
        assert torch.allclose(a.shared[n], b.shared[n], atol=1e-8), n
    for j in range(3):
        for n in a.local[j]:
            assert torch.allclose(a.local[j][n], b.local[j][n], atol=1e-8), n
    assert np.allclose(ma[-1]["loss"], mb[-1]["loss"], atol=1e-8)
    assert not torch.equal(a.shared["stem.0.weight"], sequential.initial["stem.0.weight"])


def digits_config(rounds: int) -> RunConfig:
    return RunConfig(
        data=DataConfig("digits", clients=3, classes_per_client=3, input_size=16, scale=0.2, seed=1),
        fleet=FleetConfig(width=0.25, kp=2, local_epochs=1, batch_size=16, lr=0.05, seed=1),
        rounds=rounds,
        device="cpu",
    )


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path):
    whole = run_experiment(digits_config(3), tmp_path / "whole", show_progress=False)
    runner = CliRunner()
    args = ["run", "--dataset", "digits", "--clients", "3", "--classes-per-client", "3", "--input-size", "16",
            "--width", "0.25", "--local-epochs", "1", "--batch-size", "16", "--lr", "0.05", "--seed", "1",
            "--device", "cpu", "--out", str(tmp_path / "split"), "--no-progress"]
    # --scale 0.2 shrinks rounds too: 10 rounds * 0.2 = 2, then resume to 15 * 0.2 = 3
    first = runner.invoke(app, [*args, "--rounds", "10", "--scale", "0.2"])
    assert first.exit_code == 0, first.output
    assert json.loads((tmp_path / "split" / "summary.json").read_text())["rounds"] == 2
    again = runner.invoke(app, [*args, "--rounds", "10", "--scale", "0.2"])
    assert again.exit_code == 2 and "--resume" in again.output
    resumed = runner.invoke(app, [*args, "--rounds", "15", "--scale", "0.2", "--resume"])
    assert resumed.exit_code == 0, resumed.output
    lines = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    wanted = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in lines] == [1, 2, 3]
    assert [(m["accuracy"], m["loss"]) for m in lines] == [(m["accuracy"], m["loss"]) for m in wanted]
    a, b = load_state(tmp_path / "whole" / STATE), load_state(tmp_path / "split" / STATE)
    assert a.round == b.round == 3 and list(a.shared) == list(b.shared)
    assert all(torch.equal(a.shared[n], b.shared[n]) for n in a.shared)
    assert all(torch.equal(x[n], y[n]) for x, y in zip(a.local, b.local, strict=True) for n in x)
    assert whole["rounds"] == 3


def test_cli_reports_bad_input_in_one_line(tmp_path):
    result = CliRunner().invoke(app, ["run", "--dataset", "cifar10", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2
    assert "needs --data" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(app, ["run", "--algorithm", "fedsgd", "--out", str(tmp_path / "y")])
    assert result.exit_code == 2 and "unknown algorithm" in result.output


def test_figure_without_its_dataset_says_which_is_missing(tmp_path):
    result = CliRunner().invoke(app, ["figure", "fig7-8", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "flickr-aes" in result.output and "--data" in result.output
    result = CliRunner().invoke(app, ["figure", "fig9", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "unknown figure" in result.output


@pytest.mark.parametrize(("algorithm", "kp"), [("fedbabu", 1), ("fedrep", 1), ("fedper", 2)])
def test_run_without_kp_takes_the_head_of_the_algorithms_paper(tmp_path, algorithm, kp):
    """FedBABU's and FedRep's head is the classifier (K_P=1); FedPer's figures use K_P=2."""
    out = tmp_path / algorithm
    result = CliRunner().invoke(app, [
        "run", "--algorithm", algorithm, "--dataset", "digits", "--clients", "2", "--classes-per-client", "2",
        "--input-size", "16", "--width", "0.25", "--local-epochs", "1", "--batch-size", "16", "--rounds", "1",
        "--scale", "0.2", "--device", "cpu", "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert RunConfig.from_json((out / "config.json").read_text()).fleet.kp == kp
    assert f"K_P={kp}" in result.output


def test_fedbabu_refuses_a_head_larger_than_the_classifier(tmp_path):
    result = CliRunner().invoke(app, ["run", "--algorithm", "fedbabu", "--kp", "2", "--dataset", "digits",
                                      "--out", str(tmp_path / "x"), "--no-progress"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "fedbabu needs K_P=1, got K_P=2" in result.output and "another method" in result.output


def test_figure_a3_runs_on_cifar100_and_names_a_substitute():
    """The appendix's fine-tuning figures are CIFAR-100 and FLICKR-AES; any other --dataset is labelled."""
    from fedper.emulate.figures import _specs, dataset_tag

    specs = _specs(DataConfig(), FleetConfig())
    a3 = specs["a3"]
    assert a3.dataset == "cifar100"
    assert {c.fleet.algorithm for c in a3.curves} == {"fedper", "fedper-ft"}
    assert dataset_tag(a3, "CIFAR-100") == "CIFAR-100" and dataset_tag(a3, "FLICKR-AES") == "FLICKR-AES"
    assert dataset_tag(a3, "CIFAR-10") == "CIFAR-10, a substitute for CIFAR-100"


def test_figure_a3_without_data_names_cifar100(tmp_path):
    result = CliRunner().invoke(app, ["figure", "a3", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "runs on cifar100" in result.output and "--data" in result.output


def test_figure_rerun_with_other_settings_recomputes_its_curves(tmp_path):
    """A figure's run directories are reused only for the same settings: with another --lr the
    curves are trained again, not resumed with the old settings."""
    from fedper.emulate.experiment import RunConfig
    from fedper.emulate.figures import make_figure

    common = {"out": tmp_path, "dataset": "digits", "rounds": 1, "scale": 0.2, "show_progress": False,
              "models": ("mobilenet_v1",), "data_overrides": {"clients": 2, "classes_per_client": 2, "input_size": 8}}
    make_figure("fig5-6", fleet_overrides={"lr": 0.01, "local_epochs": 1, "batch_size": 16}, **common)
    make_figure("fig5-6", fleet_overrides={"lr": 0.02, "local_epochs": 1, "batch_size": 16}, **common)
    configs = [RunConfig.from_json(p.read_text()) for p in (tmp_path / "fig5-6").glob("*/config.json")]
    assert configs and all(c.fleet.lr == 0.02 for c in configs)


def test_figure_fig7_8_runs_on_a_flickr_aes_replica(tmp_path):
    """fig7-8's whole path (FLICKR-AES loader in its published layout, per-worker devices, FedAvg
    and FedPer, the plot) on a small replica the test writes: the real data cannot be fetched here."""
    from test_data import FLICKR_IMAGES, _write_flickr

    from fedper.emulate.figures import make_figure

    root = tmp_path / "flickr"
    (root / FLICKR_IMAGES).mkdir(parents=True)
    _write_flickr(root, [60, 70, 65])
    png = make_figure("fig7-8", out=tmp_path / "figs", data=root, rounds=1, models=("mobilenet_v1",),
                      show_progress=False, fleet_overrides={"width": 0.25, "local_epochs": 1},
                      data_overrides={"clients": 3, "input_size": 16})
    assert png.stat().st_size > 1000
    summaries = [json.loads(p.read_text()) for p in (tmp_path / "figs" / "fig7-8").glob("*/summary.json")]
    assert len(summaries) == 2 and all(s["rounds"] == 1 for s in summaries)
    configs = [json.loads(p.read_text()) for p in (tmp_path / "figs" / "fig7-8").glob("*/config.json")]
    # the paper's FLICKR-AES batch of 4 by default; the command's client count over the paper's 30
    assert [(c["fleet"]["batch_size"], c["data"]["clients"]) for c in configs] == [(4, 3), (4, 3)]


def test_emulator_selects_the_coordinators_clients_and_evaluates_every_client(tmp_path):
    """--clients-per-round M: each round's trainees are fedper.selection.select over the ids "0".."N-1"
    with the run's seed and the 1-based round, as the coordinator's --selection-seed would pick them;
    metrics.jsonl records them, and still holds every client's accuracy."""
    from fedper.selection import select

    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "run", "--dataset", "digits", "--clients", "6", "--classes-per-client", "3", "--input-size", "8",
        "--width", "0.25", "--local-epochs", "1", "--batch-size", "16", "--rounds", "4", "--seed", "3",
        "--clients-per-round", "2", "--device", "cpu", "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in lines] == [1, 2, 3, 4]
    for m in lines:
        wanted = select([str(j) for j in range(6)], 2, seed=3, round_=m["round"])
        assert m["selected"] == sorted(int(j) for j in wanted)
        assert len(m["accuracy"]) == len(m["loss"]) == 6
    assert len({tuple(m["selected"]) for m in lines}) > 1  # the ranking is drawn anew each round
    assert RunConfig.from_json((out / "config.json").read_text()).fleet.clients_per_round == 2


def test_clients_not_selected_keep_their_local_tensors_and_are_evaluated_with_the_new_aggregate():
    data = synthetic([16, 24, 20, 12])
    fleet = Fleet(FleetConfig(algorithm="fedper", kp=2, clients_per_round=2, **TINY), data)
    state, _ = run_rounds(fleet, 1)  # heads differ between clients from here on
    before = {j: {n: t.clone() for n, t in own.items()} for j, own in enumerate(state.local)}
    new, metrics = fleet.run_round(state)
    selected = metrics["selected"]
    assert selected == fleet.selected(2, 0) and len(selected) == 2
    for j in range(4):
        changed = any(not torch.equal(new.local[j][n], before[j][n]) for n in fleet.local_names)
        assert changed == (j in selected), j
    assert len(metrics["accuracy"]) == 4
    for j in set(range(4)) - set(selected):  # served: the new aggregate and its own, untrained head
        _, test_idx = data.clients[j]
        served = build_model("mobilenet_v1", 4, 0.25, 16)
        served.load_state_dict({**new.shared, **before[j]}, strict=False)
        served.eval()
        with torch.no_grad():
            predicted = served(data.x[test_idx]).argmax(1)
        assert metrics["accuracy"][j] == pytest.approx(float((predicted == data.y[test_idx]).float().mean()))


def test_only_the_selected_clients_enter_the_aggregate():
    """A selected client's training data changes the aggregate; an unselected one's does not."""
    data = synthetic([16, 16, 16, 16])
    config = FleetConfig(algorithm="fedper", kp=2, clients_per_round=2, **TINY)
    selected = Fleet(config, data).selected(1, 0)
    results = {}
    for flipped in (None, selected[0], next(j for j in range(4) if j not in selected)):
        d = dataclasses.replace(data, y=data.y.clone())
        if flipped is not None:
            d.y[d.clients[flipped][0]] = (d.y[d.clients[flipped][0]] + 1) % 4
        fleet = Fleet(config, d)
        results[flipped] = fleet.run_round(fleet.init())[0].shared
    unselected = next(j for j in range(4) if j not in selected)
    assert all(torch.equal(results[None][n], results[unselected][n]) for n in results[None])
    assert any(not torch.equal(results[None][n], results[selected[0]][n]) for n in results[None])


def test_without_clients_per_round_every_client_trains_as_before():
    """The default selects everyone, and equals M = N bit for bit (select returns all N, in client order)."""
    data = synthetic([16, 12, 20])
    (a, ma), (b, mb) = (run_rounds(Fleet(FleetConfig(algorithm="fedper", kp=2, clients_per_round=m, **TINY), data), 2)
                        for m in (None, 3))
    assert [m["selected"] for m in ma] == [[0, 1, 2]] * 2
    assert all(torch.equal(a.shared[n], b.shared[n]) for n in a.shared)
    assert [m["accuracy"] for m in ma] == [m["accuracy"] for m in mb]


def test_clients_per_round_refuses_several_processes(tmp_path):
    result = CliRunner().invoke(app, ["run", "--clients-per-round", "2", "--world-size", "2",
                                      "--out", str(tmp_path / "x"), "--no-progress"])
    assert result.exit_code == 2 and "--clients-per-round runs in one process" in result.output


def test_figure_babu_is_fedbabus_setting_with_two_client_fractions():
    """100 clients x 10 shards unless the command says otherwise, f = 0.1 and 1.0 for each algorithm (the figure
    runs in tests/test_babu.py)."""
    from fedper.emulate.figures import DATA_DEFAULTS, _specs

    assert DATA_DEFAULTS["babu"] == {"clients": 100, "partition": "shards", "shards": 10}
    babu = _specs(DataConfig(), FleetConfig())["babu"]
    assert sorted((c.fraction, c.fleet.algorithm) for c in babu.curves) == sorted(
        [(f, a) for f in (0.1, 1.0) for a in ("fedavg", "fedper", "fedbabu", "fedrep", "lg-fedavg")] + [(1.0, "local")])


def unequal_tests(data: FleetData, extra: list[int]) -> FleetData:
    """`data` with client j's test split grown by extra[j] samples of the others' training data: splits of
    unequal lengths, so the batched evaluation pads and masks."""
    trains = [tr for tr, _ in data.clients]
    pool = torch.cat(trains)
    return dataclasses.replace(data, clients=[(tr, torch.cat([te, pool[-n:]]) if n else te)
                                              for (tr, te), n in zip(data.clients, extra, strict=True)])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_batched_evaluation_equals_the_per_client_one(dtype):
    """The vmap engine evaluates every client in one vmapped pass per chunk: each client's accuracy is the
    per-client evaluation's (fedper.training.evaluate) exactly, its loss to the dtype's rounding, whatever the
    lengths of the test splits and the chunk (a chunk boundary inside one client's split and past another's)."""
    data = unequal_tests(synthetic([17, 9, 24]), [0, 5, 13])
    data = dataclasses.replace(data, x=data.x.to(dtype))
    fleet = Fleet(FleetConfig(algorithm="fedper", kp=2, engine="vmap", **TINY), data)
    fleet.model.to(dtype)
    fleet.initial = {n: t.to(dtype) for n, t in fleet.initial.items()}
    state, _ = run_rounds(fleet, 1)  # trained, and every client with its own head
    reference = [fleet.evaluate_client(j, state.shared, state.local[j]) for j in range(3)]
    assert len({a for a, _ in reference}) > 1  # the clients' own heads score differently: rows are not mixed up
    stacked = fleet.stack(state.shared, state.local, [0, 1, 2])
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    for chunk in (256, 7):
        batched = evaluate_clients_batched(fleet.model, data.x, data.y, [te for _, te in data.clients], stacked,
                                           chunk=chunk)
        assert [a for a, _ in batched] == [a for a, _ in reference]
        assert np.allclose([loss for _, loss in batched], [loss for _, loss in reference], rtol=tolerance, atol=0)
    assert not fleet.batched_evaluation  # rounds use it on CUDA; on a CPU it is no faster than a loop
