"""Clients spread over 2 gloo processes give the same aggregate, metrics and run directory as one process."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_emulate import TINY, synthetic
from typer.testing import CliRunner

from fedper.algorithms import get_algorithm
from fedper.emulate.cli import app
from fedper.emulate.distributed import init_process_group, share
from fedper.emulate.experiment import STATE
from fedper.emulate.fleet import Fleet, FleetConfig, FleetState, load_state

SIZES = [16, 9, 24]  # unequal n_j, and an odd number of clients over 2 ranks


def fleet(members=None, algorithm: str = "fedper") -> Fleet:
    """In float64: float32 rounding differs with thread counts and a fresh deep net amplifies it."""
    data = synthetic(SIZES)
    kp = 0 if get_algorithm(algorithm).requires_kp0 else 2
    f = Fleet(FleetConfig(algorithm=algorithm, kp=kp, **TINY), dataclasses.replace(data, x=data.x.double()),
              members=members)
    f.model.double()
    f.initial = {n: t.double() for n, t in f.initial.items()}
    return f


ALGORITHMS = ("fedper", "local")  # local: nothing shared, nothing to all_reduce


def worker(rank: int, world_size: int, rendezvous: str, out: str) -> None:
    """One round of each algorithm (one pair of processes for both: each costs seconds of imports)."""
    torch.set_num_threads(1)
    init_process_group(rank, world_size, rendezvous)
    try:
        for algorithm in ALGORITHMS:
            f = fleet(share(len(SIZES), rank, world_size), algorithm)
            state, metrics = f.run_round(f.init())
            if rank == 0:
                torch.save({"shared": state.shared, "accuracy": metrics["accuracy"], "loss": metrics["loss"]},
                           f"{out}/{algorithm}.pt")
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_aggregate_like_one_process(tmp_path):
    mp.spawn(worker, args=(2, f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2, join=True)
    for algorithm in ALGORITHMS:
        spread = torch.load(tmp_path / f"{algorithm}.pt", weights_only=True)
        one = fleet(algorithm=algorithm)
        single, metrics = one.run_round(one.init())
        assert set(spread["shared"]) == set(single.shared), algorithm
        for name, value in single.shared.items():
            assert torch.allclose(spread["shared"][name], value, rtol=0, atol=1e-9), (algorithm, name)
        assert spread["accuracy"] == metrics["accuracy"], algorithm
        assert spread["loss"] == pytest.approx(metrics["loss"], abs=1e-8), algorithm


# 3 clients over 2 ranks; --scale 0.3 keeps 30% of the digits and of the rounds (4 -> 1, 7 -> 2);
# lr 0.1 with momentum so that round 2's accuracies differ from round 1's (a resume that lost
# state would show). Every client sees every class: with 4 random classes each, this lr makes
# training chaotic, and the ulp by which the all_reduce's sum may differ grows into other accuracies.
RUN = ["run", "--dataset", "digits", "--clients", "3", "--classes-per-client", "10", "--width", "0.25",
       "--local-epochs", "1", "--batch-size", "16", "--input-size", "16", "--lr", "0.1", "--momentum", "0.9",
       "--scale", "0.3", "--no-progress"]


def cli(*args: str) -> None:
    result = CliRunner().invoke(app, [*RUN, *args])
    assert result.exit_code == 0, result.output


def saved(out) -> tuple[list[dict], FleetState]:
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return metrics, load_state(out / STATE)


@pytest.mark.long
def test_cli_world_size_2_then_torchrun_resume_match_one_process(tmp_path, monkeypatch):
    """One thread per process everywhere, so each client's float32 training is the same computation;
    the shared tensors may still differ by an ulp (the all_reduce sums the float64 n_j-weighted
    sums in another order than one WeightedMean), hence the tolerance on tensors and losses."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # inherited by the spawned and torchrun processes
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cli("--rounds", "7", "--out", str(tmp_path / "one"))
    finally:
        torch.set_num_threads(threads)
    cli("--rounds", "4", "--world-size", "2", "--out", str(tmp_path / "two"))
    (one_metrics, one), (two_metrics, two) = saved(tmp_path / "one"), saved(tmp_path / "two")
    assert two.round == 1 and len(two_metrics) == 1
    assert two_metrics[0]["accuracy"] == one_metrics[0]["accuracy"]

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "fedper.emulate.cli", *RUN, "--rounds", "7", "--resume", "--out", str(tmp_path / "two")]
    done = subprocess.run(torchrun, capture_output=True, text=True, timeout=120, env=os.environ)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("mean accuracy") == 1  # rank 0 alone reports
    two_metrics, two = saved(tmp_path / "two")
    assert two.round == one.round == 2
    assert [m["accuracy"] for m in two_metrics] == [m["accuracy"] for m in one_metrics]
    assert one_metrics[1]["accuracy"] != one_metrics[0]["accuracy"]  # round 2 did learn something new
    for a, b in zip(two_metrics, one_metrics, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    for name, value in one.shared.items():
        assert torch.allclose(two.shared[name], value, rtol=1e-5, atol=1e-6), name
    assert len(two.local) == 3  # every rank's clients, gathered to rank 0
    for j, own in enumerate(one.local):
        for name, value in own.items():
            assert torch.allclose(two.local[j][name], value, rtol=1e-5, atol=1e-6), (j, name)
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["rounds"] == 2
