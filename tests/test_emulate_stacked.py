"""Experiments stacked (emulate/stacked.py): runs trained as rows of one vmapped step end exactly where each
run alone ends, whatever their algorithm, partition, seed, lr or client selection, and however the stack is
cut to fit memory."""

from __future__ import annotations

import dataclasses
import json

import torch
from test_emulate import synthetic

from fedper.emulate.data import FleetData
from fedper.emulate.fleet import Fleet, FleetConfig, FleetState
from fedper.emulate.stacked import chunks, row_bytes, stacked_round

# float64 convolutions under vmap are slow on a CPU: 8x8 images, few samples, one round (a round starts from its
# state alone, which the tests compare too), and a small lr: this tiny net's gradients are large, so a larger lr
# would let float32 rounding grow into differences of any size
TINY = {"width": 0.25, "local_epochs": 1, "batch_size": 8, "lr": 0.001}
ROUNDS = 1


def runs(dtype: torch.dtype) -> list[tuple[FleetConfig, FleetData]]:
    """Four runs on one resident data set: two algorithms with one step (FedAvg, FedPer), one with other phases
    (FedRep: a group of its own), other partitions, seeds and learning rates, and a run selecting 2 of 3."""
    base = synthetic([9, 5, 12, 6, 10], side=8)
    data = dataclasses.replace(base, x=base.x.to(dtype))
    parts = [data.clients[:3], data.clients[2:], data.clients[1:4], data.clients[::2]]  # other partitions
    configs = [
        FleetConfig(algorithm="fedper", kp=2, momentum=0.9, seed=0, engine="vmap", **TINY),
        FleetConfig(algorithm="fedavg", kp=0, momentum=0.9, seed=1, engine="vmap", **TINY | {"lr": 0.0006}),
        FleetConfig(algorithm="fedrep", kp=2, momentum=0.9, seed=2, engine="vmap", **TINY),
        FleetConfig(algorithm="fedper", kp=2, momentum=0.9, seed=3, engine="vmap", clients_per_round=2, **TINY),
    ]
    return [(c, dataclasses.replace(data, clients=list(p))) for c, p in zip(configs, parts, strict=True)]


def fleet(config: FleetConfig, data: FleetData, dtype: torch.dtype) -> Fleet:
    made = Fleet(config, data)
    made.model.to(dtype)
    made.initial = {n: t.to(dtype) for n, t in made.initial.items()}
    return made


def alone(config: FleetConfig, data: FleetData, dtype: torch.dtype) -> tuple[FleetState, list[dict]]:
    run = fleet(config, data, dtype)
    state, history = run.init(), []
    for _ in range(ROUNDS):
        state, metrics = run.run_round(state)
        history.append(metrics)
    return state, history


def stacked(dtype: torch.dtype, budget: int | None = None, only: int = 4) -> list[tuple[FleetState, list[dict]]]:
    """The first `only` runs stacked."""
    fleets = [fleet(c, d, dtype) for c, d in runs(dtype)[:only]]
    states = [f.init() for f in fleets]
    histories: list[list[dict]] = [[] for _ in fleets]
    for _ in range(ROUNDS):
        results = stacked_round(fleets, states, budget=budget)
        states = [state for state, _ in results]
        for history, (_, metrics) in zip(histories, results, strict=True):
            history.append(metrics)
    return list(zip(states, histories, strict=True))


def distances(a: tuple[FleetState, list[dict]], b: tuple[FleetState, list[dict]]) -> dict[str, float]:
    """The largest difference of each tensor (shared, then every client's local ones) and of the losses."""
    (sa, ha), (sb, hb) = a, b
    assert sa.round == sb.round == len(ha) == len(hb)
    assert [m["selected"] for m in ha] == [m["selected"] for m in hb]
    out = {n: float((sa.shared[n] - sb.shared[n]).abs().max()) for n in sa.shared}
    for j, (la, lb) in enumerate(zip(sa.local, sb.local, strict=True)):
        out |= {f"{j}/{n}": float((la[n] - lb[n]).abs().max()) for n in la if la[n].is_floating_point()}
    out["loss"] = max(abs(x - y) for ma, mb in zip(ha, hb, strict=True) for x, y in zip(ma["loss"], mb["loss"],
                                                                                      strict=True))
    return out


def test_a_stacked_run_ends_where_the_same_run_alone_ends():
    """float64: to 1e-10. float32: to rounding, which rows in a vmapped step of another size change (the order of
    its sums), and which this net amplifies: within ten times the distance between the run alone in float32 and
    in float64, the size of float32's rounding here."""
    wide, narrow = stacked(torch.float64), stacked(torch.float32)
    for (config, data), together64, together32 in zip(runs(torch.float64), wide, narrow, strict=True):
        alone64 = alone(config, data, torch.float64)
        for name, d in distances(together64, alone64).items():
            assert d <= 1e-10 * max(1.0, float(together64[0].shared.get(name, torch.ones(1)).abs().max())), name
        alone32 = alone(dataclasses.replace(config), dataclasses.replace(data, x=data.x.float()), torch.float32)
        rounding = distances(alone32, alone64)
        for name, d in distances(together32, alone32).items():
            assert d <= 10 * rounding[name] + 1e-6, (name, d, rounding[name])
        first = next(iter(alone64[0].shared))
        assert not torch.equal(together64[0].shared[first], fleet(config, data, torch.float64).initial[first])
    # the runs differ from each other: the stack did not hand one run's rows to another
    assert not torch.equal(wide[0][0].shared["stem.0.weight"], wide[3][0].shared["stem.0.weight"])


def test_a_stack_cut_to_fit_a_small_memory_budget_gives_the_same_results():
    fleets = [fleet(c, d, torch.float64) for c, d in runs(torch.float64)]
    per_row = row_bytes(fleets[0])
    assert per_row > 0
    assert [len(c) for c in chunks(7, per_row, 3 * per_row)] == [3, 3, 1]
    assert [len(c) for c in chunks(7, per_row, 1)] == [1] * 7  # below one row: one row at a time
    for cut, whole in zip(stacked(torch.float64, budget=2 * per_row, only=2), stacked(torch.float64, only=2),
                          strict=True):
        assert max(distances(cut, whole).values()) <= 1e-12


def test_sweep_runs_every_combination_stacked_and_reuses_finished_runs(tmp_path):
    from typer.testing import CliRunner

    from fedper.emulate.cli import app

    args = ["sweep", "--seeds", "0,1", "--lr", "0.05,0.02", "--out", str(tmp_path), "--no-progress", "--clients", "3",
            "--classes-per-client", "3", "--input-size", "8", "--scale", "0.1", "--width", "0.25", "--local-epochs",
            "1", "--batch-size", "16", "--rounds", "10", "--device", "cpu"]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    runs = sorted(p.name for p in tmp_path.iterdir())
    assert runs == [f"fedper-k3-lr{lr}-seed{s}" for lr in ("0.02", "0.05") for s in (0, 1)]
    for name in runs:
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert (config["fleet"]["lr"], config["fleet"]["seed"], config["data"]["seed"]) == (
            float(name.split("-lr")[1].split("-")[0]), int(name[-1]), int(name[-1]))
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["rounds"] == 1 and summary["stacked"] == 4
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and "0 runs stacked" in again.output, again.output
    bad = CliRunner().invoke(app, ["sweep", "--out", str(tmp_path / "x"), "--no-such-option"])
    assert bad.exit_code == 2 and "--no-such-option" in bad.output


def test_figure_stack_trains_the_figures_runs_stacked_and_draws_them(tmp_path):
    from fedper.emulate.figures import make_figure

    png = make_figure("fig3", out=tmp_path, dataset="digits", device="cpu", rounds=10, scale=0.1, stack=True,
                      show_progress=False,
                      fleet_overrides={"width": 0.25, "local_epochs": 1, "batch_size": 16},
                      data_overrides={"clients": 3, "classes_per_client": 3, "input_size": 8})
    assert png.is_file()
    summaries = [json.loads(p.read_text()) for p in sorted((tmp_path / "fig3").glob("*/summary.json"))]
    assert [s["algorithm"] for s in summaries] == ["fedavg", "fedper"]
    assert all(s["stacked"] == 2 and s["engine"] == "vmap" and s["rounds"] == 1 for s in summaries)
