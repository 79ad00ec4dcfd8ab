"""Experiments stacked: the rounds of several runs (fleets) whose models share an architecture train as
one batched step, every client of every run a row of the vmap engine (emulate/batched.py).

Each run keeps everything that makes it its own: its partition (its clients' indices into the resident
data), algorithm, seed (its clients' batch keys and selection), learning rate, local tensors and its
aggregation and evaluation, which Fleet.finish_round does for it exactly as for a run alone. What rows
share is the step: the same tensor names and shapes, the same phases (what each trains and for how many
epochs, which BatchNorm layers track statistics), batch size and momentum; runs that differ there train
in separate groups of the same round. A group too large for the device's memory is cut into chunks of
rows, trained one after another: rows never interact, so a chunk's results are the same as in one step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from fedper.batches import PURPOSE_TRAIN
from fedper.emulate.batched import train_clients_batched
from fedper.emulate.data import Images, cat_images
from fedper.emulate.fleet import Fleet, FleetState, Tensors
from fedper.emulate.train import OnStep, client_generator
from fedper.training import freeze_for_phase

MEMORY_SHARE = 0.7  # of the device's free memory (CUDA) or of the host's memory (CPU) a stacked step may take
Signature = tuple


def step_signature(fleet: Fleet) -> Signature:
    """What rows of a stacked step must share: the model's tensors, and per phase its trained tensors, epochs and
    the BatchNorm layers that track statistics; the batch size, momentum, data type, device, precision and
    layout."""
    cfg, model = fleet.config, fleet.model
    phases = []
    for phase in fleet.algorithm.phases:
        names = freeze_for_phase(model, fleet.manifest, phase.trained)
        tracking = tuple(m.track_running_stats for m in model.modules()
                         if isinstance(m, nn.modules.batchnorm._BatchNorm))
        phases.append((tuple(names), phase.epochs or cfg.local_epochs, tracking))
    model.requires_grad_(True)
    tensors = tuple((n, tuple(t.shape), t.dtype) for n, t in model.state_dict().items())
    return (type(model).__name__, tensors, tuple(phases), cfg.batch_size, cfg.momentum, str(fleet.device),
            fleet.data.x.dtype, cfg.precision, fleet.batched_channels_last)


def row_bytes(fleet: Fleet) -> int:
    """An estimate of one row's memory in a stacked step: its tensors four times (the row, its gradient, SGD's
    velocity, vmap's temporaries) and three times the activations of one batch (kept for the backward pass,
    their gradients, and slack), measured by a forward pass over one batch."""
    model, x = fleet.model, fleet.data.x
    sizes: list[int] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: sizes.append(out.numel() * out.element_size()))
             for m in model.modules() if not list(m.children())]
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(x[: min(len(x), fleet.config.batch_size)])
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    scale = fleet.config.batch_size / max(1, min(len(x), fleet.config.batch_size))
    tensors = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return int(4 * tensors + 3 * scale * sum(sizes))


def memory_budget(device: torch.device) -> int:
    """The bytes a stacked step may take: MEMORY_SHARE of what CUDA reports free, or of the host's memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(MEMORY_SHARE * free)
    return int(MEMORY_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def chunks(rows: int, per_row: int, budget: int) -> list[range]:
    """`rows` cut into consecutive chunks of at most budget // per_row rows (at least one each)."""
    size = max(1, budget // max(1, per_row))
    return [range(start, min(rows, start + size)) for start in range(0, rows, size)]


def _shared_data(fleets: Sequence[Fleet]) -> tuple[Images, torch.Tensor, list[int]]:
    """One (x, y) for every fleet's rows and each fleet's offset into it: the fleets' own when they all hold the
    same tensors (runs loaded by run_stacked share them), else their concatenation."""
    unique: dict[int, int] = {}
    parts: list[Fleet] = []
    offsets = []
    for fleet in fleets:
        key = fleet.data.x.data_ptr()
        if key not in unique:
            unique[key] = sum(len(f.data.x) for f in parts)
            parts.append(fleet)
        offsets.append(unique[key])
    if len(parts) == 1:
        return parts[0].data.x, parts[0].data.y, offsets
    return cat_images([f.data.x for f in parts]), torch.cat([f.data.y for f in parts]), offsets


def stacked_round(
    fleets: Sequence[Fleet],
    states: Sequence[FleetState],
    *,
    budget: int | None = None,
    on_steps: Sequence[OnStep | None] | None = None,
) -> list[tuple[FleetState, dict]]:
    """One round of every fleet (from its state), their training stacked; each fleet's (new state, metrics) as
    its run_round would return them. `budget`: the bytes a step may take (default: memory_budget of the
    device); `on_steps`: each fleet's progress callback, in the units of its round_steps."""
    if any(len(f.members) < len(f.data.clients) for f in fleets):
        raise ValueError("stacked runs train in one process: drop --world-size (or torchrun)")
    start = time.perf_counter()
    on_steps = list(on_steps) if on_steps is not None else [None] * len(fleets)
    trainees = [fleet.trainees(state) for fleet, state in zip(fleets, states, strict=True)]
    trained: list[dict[int, tuple[Tensors, Tensors]]] = [{} for _ in fleets]
    groups: dict[Signature, list[int]] = {}
    for i, fleet in enumerate(fleets):
        if trainees[i]:
            groups.setdefault(step_signature(fleet), []).append(i)
    for members in groups.values():
        rows = [(i, j) for i in members for j in trainees[i]]
        group = [fleets[i] for i in members]
        per_row = row_bytes(group[0])
        limit = memory_budget(group[0].device) if budget is None else budget
        for chunk in chunks(len(rows), per_row, limit):
            _train_rows(fleets, states, [rows[r] for r in chunk], trained, on_steps)
    share = (time.perf_counter() - start) / len(fleets)  # each run's wall_s counts its share of the stacked step
    results = []
    for i, (fleet, state) in enumerate(zip(fleets, states, strict=True)):
        begun = time.perf_counter() - share
        results.append(fleet.finish_round(state, ((j, trained[i][j]) for j in trainees[i]), begun, on_steps[i]))
    return results


def _train_rows(fleets: Sequence[Fleet], states: Sequence[FleetState], rows: list[tuple[int, int]],
                trained: list[dict[int, tuple[Tensors, Tensors]]], on_steps: list[OnStep | None]) -> None:
    """Train `rows` ((fleet, client) pairs of one signature) in one vmapped engine call; store their tensors."""
    runs = sorted({i for i, _ in rows})
    x, y, offsets = _shared_data([fleets[i] for i in runs])
    offset = dict(zip(runs, offsets, strict=True))
    first = fleets[runs[0]]
    names = [*first.shared_names, *first.local_names]
    stacked = {n: torch.stack([(states[i].shared | states[i].local[j])[n] for i, j in rows]) for n in names}
    settings = [fleets[i].train_settings(states[i].round + 1) for i, _ in rows]
    report: Callable[[list[int]], None] | None = None
    if any(on_steps[i] is not None for i in runs):
        def report(members: list[int]) -> None:
            for r in members:
                tell = on_steps[rows[r][0]]
                if tell is not None:
                    tell(1)
    with first.compute():
        train_clients_batched(
            first.model, first.manifest, first.algorithm.phases, x, y,
            [fleets[i].data.clients[j][0] + offset[i] for i, j in rows], stacked,
            local_epochs=settings[0]["local_epochs"], batch_size=settings[0]["batch_size"],
            lr=[s["lr"] for s in settings], momentum=settings[0]["momentum"],
            generators=[client_generator(states[i].seed, states[i].round, j, PURPOSE_TRAIN) for i, j in rows],
            on_rows=report, channels_last=first.batched_channels_last)
    for r, (i, j) in enumerate(rows):
        fleet = fleets[i]
        trained[i][j] = ({n: stacked[n][r] for n in fleet.shared_names},
                         {n: stacked[n][r].clone() for n in fleet.local_names})
