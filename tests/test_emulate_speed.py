"""The emulator's speed options change how the arithmetic runs, never what it computes.

channels_last (the CPU default) hands each float32 batch to the model in NHWC memory order: the
same operations summed in another order, so a step agrees with the NCHW step to float32 rounding
(docs/performance.md, emulator section)."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from fedper.algorithms import ALGORITHMS
from fedper.batches import PURPOSE_TRAIN
from fedper.emulate.cli import app
from fedper.emulate.data import FleetData
from fedper.emulate.fleet import Fleet, FleetConfig
from fedper.emulate.train import client_generator, train_client
from fedper.models import exported_state
from fedper.training import load_tensors

TINY = {"width": 0.25, "local_epochs": 1, "batch_size": 8, "lr": 0.05, "momentum": 0.9}


def learnable(sizes: list[int], classes: int = 4, side: int = 16, dtype: torch.dtype = torch.float32) -> FleetData:
    """Each class its own mean pattern plus noise; client j gets sizes[j] train and 8 test samples."""
    g = torch.Generator().manual_seed(0)
    patterns = torch.randn(classes, 3, side, side, generator=g)
    n = sum(sizes) + 8 * len(sizes)
    y = torch.randint(0, classes, (n,), generator=g)
    x = (patterns[y] + 0.5 * torch.randn(n, 3, side, side, generator=g)).to(dtype)
    clients, start = [], 0
    for size in sizes:
        clients.append((torch.arange(start, start + size), torch.arange(start + size, start + size + 8)))
        start += size + 8
    return FleetData(x=x, y=y, clients=clients, classes=[str(c) for c in range(classes)])


def trained(data: FleetData, channels_last: bool, steps: int) -> tuple[dict[str, torch.Tensor], list[bool]]:
    """Client 0's tensors after `steps` SGD steps from the fleet's initial model (train_client), and,
    per step, whether the first convolution saw its input in channels_last order."""
    fleet = Fleet(FleetConfig(algorithm="fedper", kp=2, **TINY), data)
    fleet.model.to(data.x.dtype)
    load_tensors(fleet.model, {n: t.to(data.x.dtype) for n, t in fleet.initial.items()})
    seen: list[bool] = []
    hook = fleet.model.stem[0].register_forward_pre_hook(
        lambda _, inputs: seen.append(inputs[0].is_contiguous(memory_format=torch.channels_last)))
    train_client(fleet.model, fleet.manifest, ALGORITHMS["fedper"].phases, data.x, data.y, data.clients[0][0],
                 local_epochs=1, batch_size=TINY["batch_size"] * steps, lr=0.01, momentum=0.0,
                 generator=client_generator(0, 0, 0, PURPOSE_TRAIN), channels_last=channels_last)
    hook.remove()
    return {n: t.detach().clone() for n, t in exported_state(fleet.model).items()}, seen


def test_channels_last_is_the_cpu_default():
    fleet = Fleet(FleetConfig(**TINY), learnable([9, 9]))
    assert FleetConfig().channels_last and fleet.channels_last


def test_cuda_channels_last_leaves_the_cpu_paths_alone():
    """--cuda-channels-last is for CUDA: a CPU keeps --channels-last's choice (sequential engine) and NCHW (vmap)."""
    data = learnable([8, 8])
    for channels_last in (True, False):
        config = FleetConfig(cuda_channels_last=True, channels_last=channels_last, **TINY)
        assert Fleet(config, data).channels_last is channels_last
        assert not Fleet(FleetConfig(cuda_channels_last=True, engine="vmap", **TINY), data).batched_channels_last


def test_a_channels_last_step_is_the_nchw_step_to_float32_rounding():
    """One step (one batch of 24) from the same tensors: the change of every tensor, BatchNorm's running
    statistics included, agrees to 1e-2 in norm (1.4e-3 measured; BatchNorm scales, whose step is ~1e-6,
    differ most); another batch or a lost update differs by the whole step. (Several steps on a fresh
    thin network amplify any rounding to the size of the step itself: only one step can be compared.)"""
    data = learnable([24, 9], side=32)
    start = {n: t.clone() for n, t in Fleet(FleetConfig(algorithm="fedper", kp=2, **TINY), data).initial.items()}
    (fast, fast_seen), (plain, plain_seen) = trained(data, True, 3), trained(data, False, 3)
    assert fast_seen == [True] and plain_seen == [False]
    difference = torch.cat([(fast[n] - plain[n]).flatten() for n in start]).norm()
    step = torch.cat([(plain[n] - start[n]).flatten() for n in start]).norm()
    assert step > 0 and difference <= 1e-2 * step


def test_float64_keeps_nchw():
    """No oneDNN kernels in float64: the layout is left alone, so float64 tests compare engines exactly."""
    _, seen = trained(learnable([24, 9], dtype=torch.float64), True, 1)
    assert seen == [False] * 3


def test_the_cli_turns_channels_last_off(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", "--dataset", "digits", "--clients", "2", "--input-size", "16",
                                      "--width", "0.25", "--rounds", "1", "--local-epochs", "1", "--batch-size", "32",
                                      "--scale", "0.1", "--device", "cpu", "--no-channels-last", "--no-progress",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["fleet"]["channels_last"] is False
