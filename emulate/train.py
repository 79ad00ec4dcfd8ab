"""Local training of one client, and evaluation: plain PyTorch on one working model.

A phase trains the trainable tensors of one role ("head", "base") or of both ("all"). Tensors of
the other role are frozen by requires_grad, and their BatchNorm layers run in eval mode, so a
frozen layer stays exactly as it was, running statistics included (FedBABU's fixed head, FedRep's
base during its head epochs). Batch order comes from a generator seeded by (seed, round, client),
so both engines, and a resumed run, draw the very same batches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedper.algorithms import Phase, Trained
from fedper.manifest import Manifest

EVAL_CHUNK = 1000  # test samples per forward pass at evaluation
PURPOSE_TRAIN, PURPOSE_FINETUNE = 0, 1


def client_generator(seed: int, round_: int, client: int, purpose: int) -> torch.Generator:
    """An independent stream per (run seed, round, client, purpose): the round index is the RNG state."""
    state = np.random.SeedSequence([seed, round_, client, purpose]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


def epoch_batches(n: int, batch_size: int, generator: torch.Generator) -> list[torch.Tensor]:
    """A shuffled epoch of positions 0..n-1 in batches; a lone last sample joins the batch before it,
    because BatchNorm in train mode needs more than one sample."""
    batches = list(torch.randperm(n, generator=generator).split(batch_size))
    if len(batches) > 1 and len(batches[-1]) == 1:
        batches[-2:] = [torch.cat(batches[-2:])]
    return batches


def trained_names(manifest: Manifest, trained: Trained) -> list[str]:
    return [t.name for t in manifest.tensors if t.trainable and trained in ("all", t.role)]


def prepare_phase(model: nn.Module, manifest: Manifest, trained: Trained) -> list[str]:
    """Train mode, requires_grad on the phase's parameters only, frozen BatchNorm layers in eval mode."""
    names = set(trained_names(manifest, trained))
    model.train()
    for name, param in model.named_parameters():
        param.requires_grad_(name in names)
    for module_name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and f"{module_name}.weight" not in names:
            module.eval()
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
    generator: torch.Generator,
) -> None:
    """Run the algorithm's phases on one client's training samples, in place on `model`."""
    params = dict(model.named_parameters())
    for phase in phases:
        names = prepare_phase(model, manifest, phase.trained)
        optimizer = torch.optim.SGD([params[n] for n in names], lr=lr, momentum=momentum)
        for _ in range(phase.epochs or local_epochs):
            for batch in epoch_batches(len(train_idx), batch_size, generator):
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
