"""The vmap engine's captured step (--capture) and NHWC batches on CUDA (--cuda-channels-last): opt-in options,
refused where they cannot apply, and a compiled step that trains as the eager one does."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from test_emulate import TINY, run_rounds, synthetic

from fedper.emulate.fleet import Fleet, FleetConfig


def test_capture_needs_the_vmap_engine_and_cudagraphs_a_gpu() -> None:
    data = synthetic([8, 8])
    with pytest.raises(ValueError, match="unknown capture"):
        Fleet(FleetConfig(capture="graphs", **TINY), data)
    with pytest.raises(ValueError, match="--engine vmap"):
        Fleet(FleetConfig(capture="compile", engine="sequential", **TINY), data)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Fleet(FleetConfig(capture="cudagraphs", engine="vmap", **TINY), data)


def test_cuda_channels_last_leaves_the_cpu_paths_alone() -> None:
    """The CPU keeps --channels-last's choice for the sequential engine and NCHW for the vmap one."""
    data = synthetic([8, 8])
    for channels_last in (True, False):
        config = FleetConfig(cuda_channels_last=True, channels_last=channels_last, **TINY)
        assert Fleet(config, data).channels_last is channels_last
        assert not Fleet(dataclasses.replace(config, engine="vmap"), data).batched_channels_last


@pytest.mark.skipif(os.environ.get("FEDPER_TEST_COMPILE") != "1",
                    reason="torch.compile of the vmapped step took 218 s for one batch shape on this 2-core CPU "
                           "(torch 2.11): set FEDPER_TEST_COMPILE=1 to run it")
@pytest.mark.timeout(1800)
def test_a_compiled_round_equals_the_eager_one_to_float32_rounding() -> None:
    """One FedPer round with every batch the same shape (16 samples a client, batch 8: one compilation):
    the compiled step's tensors and accuracies against the eager step's."""
    torch.set_num_threads(1)
    data = synthetic([16, 16])
    eager = Fleet(FleetConfig(algorithm="fedper", kp=2, engine="vmap", **TINY), data)
    compiled = Fleet(FleetConfig(algorithm="fedper", kp=2, engine="vmap", capture="compile", **TINY), data)
    (a, ma), (b, mb) = run_rounds(eager, 1), run_rounds(compiled, 1)
    moved = 0.0
    for name in a.shared:
        scale = float(a.shared[name].abs().max()) + 1e-6
        assert torch.allclose(a.shared[name], b.shared[name], rtol=1e-4, atol=1e-4 * scale), name
        moved = max(moved, float((a.shared[name] - eager.initial[name]).abs().max()))
    assert moved > 1e-3  # the round trained: equal tensors are not the initial ones
    assert ma[0]["accuracy"] == mb[0]["accuracy"]
