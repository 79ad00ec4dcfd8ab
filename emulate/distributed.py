"""Spread a fleet's clients over processes with torch.distributed (gloo on CPU, NCCL on GPU).

Each rank trains and evaluates its share of the clients; the shared tensors are combined with an
all_reduce of the n_j-weighted sums and of sum n_j, which is WeightedMean over all clients (both
accumulate in float64), and the per-client metrics are all-gathered. Without an initialized
process group every function here is the single-process identity.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

from fedper.aggregation import WeightedMean


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def as_float64(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.double() for n, t in tensors.items()}


def combine(rule: WeightedMean, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The n_j-weighted mean over every rank's clients, in the dtypes of `like`."""
    mean = rule.result()
    if active():
        total = torch.tensor([rule.total_weight], dtype=torch.float64, device=next(iter(mean.values())).device)
        sums = {n: m * rule.total_weight for n, m in mean.items()}
        for t in (*sums.values(), total):
            dist.all_reduce(t)
        mean = {n: s * (1.0 / float(total)) for n, s in sums.items()}
    return {n: m.to(like[n].dtype) for n, m in mean.items()}


def gather(results: dict[int, tuple[float, float]]) -> list[tuple[float, float]]:
    """Per-client (accuracy, loss) of every rank, in client order."""
    if active():
        parts: list[dict[int, tuple[float, float]]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(parts, results)
        results = {j: r for part in parts for j, r in part.items()}
    return [results[j] for j in sorted(results)]


def share(n_clients: int, rank: int, world_size: int) -> list[int]:
    """Rank r trains clients r, r + W, r + 2W, ...: balanced whatever N is."""
    return list(range(rank, n_clients, world_size))


def init_process_group(rank: int, world_size: int, rendezvous: str) -> None:
    """gloo on CPU, NCCL when CUDA is present; `rendezvous` is a file:// or tcp:// init method."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=world_size)
