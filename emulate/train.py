"""Local training of one client, and evaluation: plain PyTorch on one working model.

A phase trains the trainable tensors of one role ("head", "base") or of both ("all"); the
others are frozen by requires_grad. Every BatchNorm layer runs in train mode during local
training, frozen or not, as the exported ORT graphs do on the devices (ORT_NOTES "Freezing": a
head-only graph still moves the base's running statistics), so frozen weights stay put while
their running statistics follow the local data, with ORT's biased running_var
(fedper.batches: DeferredOrtRunningVar here, ort_running_var under vmap). Batches come from the kernel's order
(fedper.batches) keyed (client_seed, round, phase_index, epoch), exactly as an agent draws them,
so both engines, a resumed run and a fleet of agents see the very same batches.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from fedper.algorithms import Phase, Trained
from fedper.batches import DeferredOrtRunningVar, client_seed, epoch_batches, ort_running_var
from fedper.manifest import Manifest

EVAL_CHUNK = 1000  # test samples per forward pass at evaluation
# The phase index a purpose's first phase draws its batches with: training phases count from 0,
# FedBABU's evaluation fine-tune from 1000, far from any algorithm's phases, so its draws differ.
PURPOSE_TRAIN, PURPOSE_FINETUNE = 0, 1000
BatchKey = tuple[int, int, int]  # (client_seed, round, first phase index)


def client_generator(seed: int, round_: int, client: int, purpose: int) -> BatchKey:
    """Client `client`'s batch key in the round after `round_` completed rounds. Rounds count from
    1, as the coordinator numbers them, so the emulator's round k draws what an agent started with
    --seed client_seed(seed, client) draws in round k."""
    return client_seed(seed, client), round_ + 1, purpose


def phase_batches(n: int, batch_size: int, key: BatchKey, phase_index: int, epoch: int) -> list[torch.Tensor]:
    """One epoch's batches (positions 0..n-1) of the `phase_index`-th phase, from the kernel's order."""
    seed, round_, first_phase = key
    return [torch.from_numpy(b) for b in epoch_batches(n, batch_size, (seed, round_, first_phase + phase_index, epoch))]


@contextmanager
def ort_batchnorm(model: nn.Module, functional: bool = False) -> Iterator[None]:
    """While training, every BatchNorm layer updates its running statistics as the ORT graphs do;
    `functional`: the model runs under torch.func (vmap), where only ort_running_var works."""
    hook = ort_running_var if functional else DeferredOrtRunningVar()
    handles = [m.register_forward_pre_hook(hook) for m in model.modules()
               if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        if not functional:
            hook.flush()


def trained_names(manifest: Manifest, trained: Trained) -> list[str]:
    return [t.name for t in manifest.tensors if t.trainable and trained in ("all", t.role)]


def prepare_phase(model: nn.Module, manifest: Manifest, trained: Trained) -> list[str]:
    """Train mode everywhere (BatchNorm of frozen layers included, as in the ORT graphs), and
    requires_grad on the phase's parameters only; returns their names in model order."""
    names = set(trained_names(manifest, trained))
    model.train()
    for name, param in model.named_parameters():
        param.requires_grad_(name in names)
    return [name for name, _ in model.named_parameters() if name in names]


@torch.no_grad()
def load_tensors(model: nn.Module, *parts: Mapping[str, torch.Tensor]) -> None:
    """Copy tensors into the working model by state_dict name (parameters and buffers alike)."""
    state = model.state_dict()
    for part in parts:
        for name, value in part.items():
            state[name].copy_(value)


def train_client(
    model: nn.Module,
    manifest: Manifest,
    phases: Sequence[Phase],
    x: torch.Tensor,
    y: torch.Tensor,
    train_idx: torch.Tensor,
    *,
    local_epochs: int,
    batch_size: int,
    lr: float,
    momentum: float,
    generator: BatchKey,
) -> None:
    """Run the algorithm's phases on one client's training samples, in place on `model`;
    `generator` is the client's batch key (client_generator)."""
    params = dict(model.named_parameters())
    with ort_batchnorm(model):
        for phase_index, phase in enumerate(phases):
            names = prepare_phase(model, manifest, phase.trained)
            optimizer = torch.optim.SGD([params[n] for n in names], lr=lr, momentum=momentum)
            for epoch in range(phase.epochs or local_epochs):
                for batch in phase_batches(len(train_idx), batch_size, generator, phase_index, epoch):
                    idx = train_idx[batch.to(train_idx.device)]
                    loss = F.cross_entropy(model(x[idx]), y[idx])
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
    model.requires_grad_(True)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of the model as served: eval mode, BatchNorm running statistics."""
    model.eval()
    correct, loss_sum = 0, 0.0
    for chunk in idx.split(EVAL_CHUNK):
        logits = model(x[chunk])
        loss_sum += float(F.cross_entropy(logits, y[chunk], reduction="sum"))
        correct += int((logits.argmax(1) == y[chunk]).sum())
    return correct / len(idx), loss_sum / len(idx)
