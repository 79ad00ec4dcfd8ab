"""Clients spread over 2 gloo processes give the same aggregate and metrics as one process."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_emulate import TINY, synthetic

from fedper.emulate.distributed import init_process_group, share
from fedper.emulate.fleet import Fleet, FleetConfig

SIZES = [16, 9, 24]  # unequal n_j, and an odd number of clients over 2 ranks


def fleet(members=None) -> Fleet:
    """In float64: float32 rounding differs with thread counts and a fresh deep net amplifies it."""
    data = synthetic(SIZES)
    f = Fleet(FleetConfig(algorithm="fedper", kp=2, **TINY), dataclasses.replace(data, x=data.x.double()),
              members=members)
    f.model.double()
    f.initial = {n: t.double() for n, t in f.initial.items()}
    return f


def worker(rank: int, world_size: int, rendezvous: str, out: str) -> None:
    torch.set_num_threads(1)
    init_process_group(rank, world_size, rendezvous)
    try:
        f = fleet(share(len(SIZES), rank, world_size))
        state, metrics = f.run_round(f.init())
        if rank == 0:
            torch.save({"shared": state.shared, "accuracy": metrics["accuracy"], "loss": metrics["loss"]}, out)
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_aggregate_like_one_process(tmp_path):
    out = tmp_path / "rank0.pt"
    mp.spawn(worker, args=(2, f"file://{tmp_path / 'rendezvous'}", str(out)), nprocs=2, join=True)
    spread = torch.load(out, weights_only=True)
    one = fleet()
    single, metrics = one.run_round(one.init())
    for name, value in single.shared.items():
        assert torch.allclose(spread["shared"][name], value, rtol=0, atol=1e-9), name
    assert spread["accuracy"] == metrics["accuracy"]
    assert spread["loss"] == pytest.approx(metrics["loss"], abs=1e-8)
