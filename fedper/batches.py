"""One batch order for the whole toolkit: the agent's backends and both emulator engines cut
every epoch with `epoch_batches`, so from the same data and seeds they train on the same batches.

An epoch's key is (client_seed, round, phase_index, epoch). A real device picks its own
client_seed (fedper-agent --seed); the emulator gives client j `client_seed(run_seed, j)`, so a
fleet of agents started with `--seed client_seed(run_seed, j)` replays an emulated run.

What a batch does to BatchNorm statistics is part of the same contract: onnxruntime-training
updates running_var with the biased batch variance, PyTorch with the unbiased one, and every
PyTorch trainer (the agent's torch backend, the emulator) hooks `ort_running_var` or
`DeferredOrtRunningVar` onto its BatchNorm layers to do what the devices' ORT graphs do.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def client_seed(run_seed: int, client: int) -> int:
    """Client `client`'s seed in a run seeded with `run_seed`: an independent stream per client."""
    return int(np.random.SeedSequence([run_seed, client]).generate_state(1, dtype=np.uint32)[0])


def epoch_batches(n: int, batch_size: int, seed: Sequence[int]) -> list[np.ndarray]:
    """One epoch: default_rng(seed).permutation(n) cut into batch_size pieces. No sample is
    dropped (ORT's batch axis is dynamic), but a lone last sample joins the batch before it,
    because BatchNorm in train mode needs at least two samples."""
    if n < 1 or batch_size < 1:
        raise ValueError(f"need at least one sample and a batch size >= 1, got n={n}, batch_size={batch_size}")
    perm = np.random.default_rng([int(s) for s in seed]).permutation(n)
    batches = [perm[i : i + batch_size] for i in range(0, n, batch_size)]
    if len(batches) > 1 and len(batches[-1]) == 1:
        batches[-2:] = [np.concatenate(batches[-2:])]
    return batches


def ort_running_var(module, inputs) -> None:
    """A BatchNorm forward pre-hook (torch-free: tensor methods only). Before a training-mode
    forward it shifts running_var so that PyTorch's update with the unbiased batch variance lands
    where onnxruntime's update with the biased one does:
    (1-m)(rv - c/(1-m)) + m*var_unbiased = (1-m)rv + m*var_biased, c = m*var_biased/(n-1).
    (After the forward would be simpler, but autograd has saved running_var by then.)"""
    if not module.training:
        return
    x = inputs[0].detach()
    n = x.numel() // x.shape[1]
    if n < 2:
        return
    var = x.var(dim=[d for d in range(x.dim()) if d != 1], unbiased=False)
    module.running_var.sub_(module.momentum * var / ((n - 1) * (1 - module.momentum)))


class DeferredOrtRunningVar:
    """A BatchNorm forward pre-hook with ort_running_var's effect at a fraction of its cost.

    ort_running_var needs the batch variance: a reduction over the whole activation, which costs
    about a third of a small CPU model's training step. This hook needs channel-sized operations
    only: PyTorch's update rv' = (1-m)rv + m*var_biased*n/(n-1) can be moved onto ORT's afterwards,
    (1-m)rv + m*var_biased = rv'(n-1)/n + (1-m)rv/n, from a copy of rv taken before the forward.
    Autograd has saved running_var until the backward, so the move waits for the layer's next
    forward, or for `flush()`, which must run before the statistics are read. The buffers must
    persist between forwards, so inside torch.func transforms (vmap) use ort_running_var.
    """

    def __init__(self) -> None:
        self._pending: dict = {}  # module -> (running_var before its last forward, n)

    def __call__(self, module, inputs) -> None:
        self._move(module)
        if module.training:
            x = inputs[0]
            self._pending[module] = (module.running_var.clone(), x.numel() // x.shape[1])

    def flush(self) -> None:
        for module in list(self._pending):
            self._move(module)

    def _move(self, module) -> None:
        before, n = self._pending.pop(module, (None, 0))
        if before is not None and n >= 2:
            module.running_var.mul_((n - 1) / n).add_(before, alpha=(1 - module.momentum) / n)
