"""Train many clients at once: their tensors stacked along a leading client axis, one vmapped
functional forward/backward per step (torch.func), data gathered from the resident tensor.

It does the same work as train.train_client on every client, with the same batches (each epoch's sample
indices made on the device in one copy, so no step waits for the host): at each step
the clients whose current batch has the same size form one vmapped group (usually all of them;
clients with fewer samples drop out of the last steps of an epoch, and last batches are smaller).
SGD (with optional momentum) is written out as torch.optim.SGD computes it, on stacked tensors.
Freezing and the BatchNorm rule are the kernel's (fedper.training); BatchNorm running statistics
are stacked buffers too, updated in place per client inside vmap. Evaluation is batched the same way:
every client's test split in one vmapped forward pass per chunk (evaluate_clients_batched).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from fedper.algorithms import Phase
from fedper.batches import EVAL_BATCH
from fedper.emulate.data import Images
from fedper.emulate.train import BatchKey, OnStep, phase_batches
from fedper.manifest import Manifest
from fedper.training import freeze_for_phase, ort_batchnorm


def train_clients_batched(
    model: nn.Module,
    manifest: Manifest,
    phases: Sequence[Phase],
    x: Images,
    y: torch.Tensor,
    train_idx: Sequence[torch.Tensor],
    stacked: dict[str, torch.Tensor],
    *,
    local_epochs: int,
    batch_size: int,
    lr: float | Sequence[float],
    momentum: float,
    generators: Sequence[BatchKey],
    on_step: OnStep | None = None,
    on_rows: Callable[[list[int]], None] | None = None,
    channels_last: bool = False,
) -> None:
    """Train every client's slice of `stacked` ({name: [clients, ...]}, all manifest tensors) in place;
    `generators` are the clients' batch keys (train.client_generator); `lr` one for all, or one per row
    (rows of stacked runs, emulate/stacked.py). `on_step` hears of each vmapped step with the number of
    client-batches it took, as train_client counts them; `on_rows` with the rows it took. `channels_last`:
    each sample handed over in NHWC memory order."""
    n_clients = len(train_idx)
    if not isinstance(lr, float | int):
        rates = list(lr)
        same = all(r == rates[0] for r in rates)
        lr = float(rates[0]) if same else torch.tensor(rates, dtype=next(iter(stacked.values())).dtype, device=x.device)
    # BatchNorm's num_batches_tracked counters (not manifest tensors) are mutated in the forward, so
    # vmap needs them batched too; they are dropped at the end.
    counters = {n: torch.stack([b] * n_clients) for n, b in model.state_dict().items() if n not in stacked}
    stacked = stacked | counters

    batched_grad = vmap(grad(_loss, argnums=1), in_dims=(None, 0, 0, 0, 0))
    every = torch.cat(list(train_idx))  # the clients' indices end to end; row j starts at starts[j]
    starts = [0, *itertools.accumulate(len(idx) for idx in train_idx)][:-1]
    row_sets: dict[tuple[int, ...], torch.Tensor] = {}  # each group's rows on the device, made once
    with ort_batchnorm(model, functional=True):
        for phase_index, phase in enumerate(phases):
            names = freeze_for_phase(model, manifest, phase.trained)
            velocity = {n: torch.zeros_like(stacked[n]) for n in names} if momentum else {}
            for epoch in range(phase.epochs or local_epochs):
                batches = [phase_batches(len(idx), batch_size, key, phase_index, epoch)
                           for idx, key in zip(train_idx, generators, strict=True)]
                samples = _epoch_samples(every, starts, batches)
                for step in range(max(len(b) for b in batches)):
                    groups: dict[tuple[int, int], list[int]] = {}  # (position, size) -> the clients there
                    for j, client_batches in enumerate(batches):
                        if step < len(client_batches):
                            at = step * batch_size  # every batch before the last is full
                            groups.setdefault((at, len(client_batches[step])), []).append(j)
                    for (at, size), members in groups.items():
                        if len(members) == n_clients:
                            sample = samples[:, at:at + size]
                        else:
                            if tuple(members) not in row_sets:
                                row_sets[tuple(members)] = torch.tensor(members, device=x.device)
                            sample = samples[row_sets[tuple(members)], at:at + size]
                        xb = x[sample]
                        if channels_last:  # [G, B, C, H, W] with C innermost: each sample NHWC under vmap
                            xb = xb.permute(0, 1, 3, 4, 2).contiguous().permute(0, 1, 4, 2, 3)
                        _step(batched_grad, model, stacked, velocity, names, members, n_clients,
                              xb, y[sample], lr, momentum, row_sets.get(tuple(members)))
                        if on_step is not None:
                            on_step(len(members))
                        if on_rows is not None:
                            on_rows(members)
    model.requires_grad_(True)


@torch.no_grad()
def evaluate_clients_batched(model: nn.Module, x: Images, y: torch.Tensor, test_idx: Sequence[torch.Tensor],
                             stacked: dict[str, torch.Tensor], *, chunk: int = EVAL_BATCH) -> list[tuple[float, float]]:
    """Each client's (accuracy, mean cross-entropy) as fedper.training.evaluate gives it (eval mode, BatchNorm's
    running statistics), every client's row of `stacked` at once: one vmapped forward pass per `chunk` test
    samples of every client (their index lists padded to the longest, the padding masked out), the sums kept on
    the device and read once at the end. Not for batch statistics, which padding would change."""
    model.eval()
    lengths = torch.tensor([len(idx) for idx in test_idx], device=y.device)
    padded = nn.utils.rnn.pad_sequence(list(test_idx), batch_first=True)  # [clients, longest], 0 past each end
    valid = torch.arange(padded.shape[1], device=y.device) < lengths.unsqueeze(1)
    forward = vmap(lambda tensors, xb: functional_call(model, tensors, (xb,)))
    correct = torch.zeros(len(test_idx), dtype=torch.int64, device=y.device)
    loss_sum = torch.zeros(len(test_idx), dtype=torch.float64, device=y.device)
    for part, keep in zip(padded.split(chunk, dim=1), valid.split(chunk, dim=1), strict=True):
        logits = forward(stacked, x[part])
        labels = y[part]
        losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
        loss_sum += torch.where(keep, losses, 0).sum(1).double()
        correct += ((logits.argmax(-1) == labels) & keep).sum(1)
    n = lengths.tolist()
    return [(c / m, s / m) if m else (float("nan"), float("nan"))
            for c, s, m in zip(correct.tolist(), loss_sum.tolist(), n, strict=True)]


def _epoch_samples(every: torch.Tensor, starts: list[int], batches: list[list[torch.Tensor]]) -> torch.Tensor:
    """One epoch's sample indices of every client as a [clients, longest] matrix on the device (row j: client
    j's batches end to end, padded): the order made on the host, moved in one copy, gathered there."""
    longest = max(sum(len(b) for b in client) for client in batches)
    positions = torch.zeros(len(batches), longest, dtype=torch.int64)
    for j, client in enumerate(batches):
        order = torch.cat(client)
        positions[j, : len(order)] = order + starts[j]
    return every[positions.to(every.device, non_blocking=True)]


def _loss(model: nn.Module, trained, rest, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(functional_call(model, {**trained, **rest}, (xb,)), yb)


@torch.no_grad()
def _step(batched_grad, model, stacked, velocity, names, members, n_clients, xb, yb, lr, momentum, rows) -> None:
    """One SGD step for the clients in `members` (on the device: `rows`, None for all) on their batches
    xb [G, B, ...], yb [G, B]."""
    whole = len(members) == n_clients
    part = stacked if whole else {n: t.index_select(0, rows) for n, t in stacked.items()}
    trained = {n: part[n] for n in names}
    rest = {n: t for n, t in part.items() if n not in trained}
    with torch.enable_grad():
        grads = batched_grad(model, trained, rest, xb, yb)
    rates = None if isinstance(lr, float | int) else (lr if whole else lr.index_select(0, rows))
    for n in names:
        g = grads[n]
        if momentum:
            v = velocity[n] if whole else velocity[n].index_select(0, rows)
            v.mul_(momentum).add_(g)
            if not whole:
                velocity[n].index_copy_(0, rows, v)
            g = v
        if rates is None:
            part[n].sub_(g, alpha=lr)
        else:  # one lr per row, broadcast over the tensor's own axes
            part[n].sub_(g * rates.view(-1, *[1] * (g.dim() - 1)))
    if not whole:  # write the group's parameters and updated running statistics back
        for n, t in part.items():
            stacked[n].index_copy_(0, rows, t)
