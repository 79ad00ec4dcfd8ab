"""Local training of one client in the emulator: the algorithm's phases on one working model.

Each phase is the kernel's (fedper.training): the phase's tensors trained by plain SGD, the others
frozen, every BatchNorm layer in train mode with ORT's running_var rule, as on the devices; frozen
BatchNorm layers keep their running statistics.
Batches come from the kernel's order (fedper.batches) keyed (client_seed, round, phase_index,
epoch), exactly as an agent draws them, so both engines, a resumed run and a fleet of agents see
the very same batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from fedper.algorithms import Phase
from fedper.batches import client_seed, epoch_batches
from fedper.emulate.data import Images
from fedper.manifest import Manifest
from fedper.training import ort_batchnorm, phase_optimizer, sgd_step

BatchKey = tuple[int, int, int]  # (client_seed, round, first phase index)
OnStep = Callable[[int], None]  # told after each training step how many client-batches it took (progress)


def client_generator(seed: int, round_: int, client: int, purpose: int) -> BatchKey:
    """Client `client`'s batch key in the round after `round_` completed rounds. Rounds count from
    1, as the coordinator numbers them, so the emulator's round k draws what an agent started with
    --seed client_seed(seed, client) draws in round k."""
    return client_seed(seed, client), round_ + 1, purpose


def epoch_steps(n: int, batch_size: int) -> int:
    """The number of batches an epoch of `n` samples is cut into (the kernel's rule, whatever the order)."""
    return len(epoch_batches(n, batch_size, (0,)))


def phase_batches(n: int, batch_size: int, key: BatchKey, phase_index: int, epoch: int) -> list[torch.Tensor]:
    """One epoch's batches (positions 0..n-1) of the `phase_index`-th phase, from the kernel's order."""
    seed, round_, first_phase = key
    return [torch.from_numpy(b) for b in epoch_batches(n, batch_size, (seed, round_, first_phase + phase_index, epoch))]


def epoch_samples(train_idx: torch.Tensor, batch_size: int, key: BatchKey, phase_index: int,
                  epoch: int) -> list[torch.Tensor]:
    """One epoch's batches of sample indices on train_idx's device: the kernel's order made on the host
    once, moved in one copy and gathered through train_idx there, then cut into views, so the steps of
    the epoch copy nothing from the host and wait for nothing."""
    batches = phase_batches(len(train_idx), batch_size, key, phase_index, epoch)
    samples = train_idx[torch.cat(batches).to(train_idx.device, non_blocking=True)]
    return list(samples.split([len(b) for b in batches]))


def train_client(
    model: nn.Module,
    manifest: Manifest,
    phases: Sequence[Phase],
    x: Images,
    y: torch.Tensor,
    train_idx: torch.Tensor,
    *,
    local_epochs: int,
    batch_size: int,
    lr: float,
    momentum: float,
    generator: BatchKey,
    channels_last: bool = True,
    on_step: OnStep | None = None,
) -> None:
    """Run the algorithm's phases on one client's training samples, in place on `model`;
    `generator` is the client's batch key (client_generator). `channels_last`: each float32 batch is
    handed to the model in NHWC memory order (values and shapes unchanged), which oneDNN's CPU
    convolutions run faster, depthwise ones above all; every activation after the first convolution,
    and its gradient, then follows that order, while the model's tensors keep theirs. Same
    arithmetic, other summation order: a step agrees with the NCHW step to float32 rounding, not bit
    for bit (docs/performance.md). Other dtypes (float64 in tests) have no oneDNN kernels to gain
    from it and keep NCHW. `on_step` hears of every step (1 client-batch each)."""
    fast = channels_last and x.dtype == torch.float32
    layout = torch.channels_last if fast else torch.contiguous_format
    with ort_batchnorm(model):
        for phase_index, phase in enumerate(phases):
            optimizer = phase_optimizer(model, manifest, phase.trained, lr=lr, momentum=momentum)
            for epoch in range(phase.epochs or local_epochs):
                for idx in epoch_samples(train_idx, batch_size, generator, phase_index, epoch):
                    sgd_step(model, optimizer, x[idx].contiguous(memory_format=layout), y[idx])
                    if on_step is not None:
                        on_step(1)
    model.requires_grad_(True)
