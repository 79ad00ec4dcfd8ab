"""A step at the hardware's pace (emulate/data.py, batched.py, fleet.py): images resident as uint8 and
normalized per batch give the very values and runs the float tensor gave; --precision bf16 trains."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fedper.emulate.data import DataConfig, FleetData, ResidentImages, load_fleet_data
from fedper.emulate.fleet import Fleet, FleetConfig
from fedper.models import IMAGENET_MEAN, IMAGENET_STD

TINY = {"width": 0.25, "local_epochs": 1, "batch_size": 8, "lr": 0.01}


@pytest.fixture(scope="module")
def digits() -> FleetData:
    """Real scans at their own 8x8 size, so no resizing: the uint8-resident path (a GPU's default, asked for here)."""
    return load_fleet_data(DataConfig(dataset="digits", input_size=8, clients=3, scale=0.1, seed=1), pixels=True)


def test_batches_hold_the_normalized_values(digits: FleetData) -> None:
    assert isinstance(digits.x, ResidentImages) and digits.x.pixels.dtype == torch.uint8
    pixels = digits.x.pixels.numpy().astype(np.float64)  # independent float64 reference: (p/255 - mean) / std
    mean = np.asarray(IMAGENET_MEAN).reshape(1, -1, 1, 1)
    std = np.asarray(IMAGENET_STD).reshape(1, -1, 1, 1)
    reference = (pixels / 255.0 - mean) / std
    idx = torch.tensor([5, 0, 17, 3, 3])
    batch = digits.x[idx]
    assert batch.dtype == torch.float32 and batch.shape == (5, *digits.x.shape[1:])
    np.testing.assert_allclose(batch.numpy(), reference[idx.numpy()], rtol=0, atol=1e-6)
    # float64 batches are the float32 values widened, as the float tensor's .double() gives
    assert torch.equal(digits.x.double()[idx], batch.double())
    rows = torch.tensor([[1, 2], [4, 0]])  # the batched engine's [clients, batch] gathers
    assert torch.equal(digits.x[rows], torch.stack([batch.new_tensor(digits.x[r].numpy()) for r in rows]))


def _run(config: FleetConfig, data: FleetData, dtype: torch.dtype, rounds: int) -> tuple[dict, list[dict]]:
    fleet = Fleet(config, data)
    fleet.model.to(dtype)
    fleet.initial = {n: t.to(dtype) for n, t in fleet.initial.items()}
    state, history = fleet.init(), []
    for _ in range(rounds):
        state, metrics = fleet.run_round(state)
        history.append(metrics)
    return state.shared, history


@pytest.mark.parametrize("engine", ["sequential", "vmap"])
def test_uint8_resident_runs_equal_the_float_tensor_runs_in_float64(digits: FleetData, engine: str) -> None:
    config = FleetConfig(algorithm="fedper", kp=2, momentum=0.9, engine=engine, **TINY)
    resident = dataclasses.replace(digits, x=digits.x.double())
    dense = dataclasses.replace(digits, x=digits.x[:].double())  # the old path: one normalized float tensor
    shared_a, history_a = _run(config, resident, torch.float64, 1)
    shared_b, history_b = _run(config, dense, torch.float64, 1)
    for name, tensor in shared_b.items():
        torch.testing.assert_close(shared_a[name], tensor, rtol=0, atol=1e-10)
    assert history_a[0]["accuracy"] == history_b[0]["accuracy"]
    assert history_a[0]["loss"] == pytest.approx(history_b[0]["loss"], abs=1e-10)


@pytest.mark.parametrize("engine", ["sequential", "vmap"])
def test_bf16_trains_near_float32(engine: str) -> None:
    """bf16 autocast on the CPU: the loss falls over the rounds, the tensors and BatchNorm statistics stay float32,
    and the final accuracy is within 0.1 of float32's on the same tiny run (digits, 3 clients of 2 classes, the
    fig. 5-6 model, which learns in 3 rounds; float32 reached 0.97 and bf16 0.97-0.985 when written). A weight copy
    autocast kept from one step to the next would diverge here (the loss grows a thousandfold)."""
    data = load_fleet_data(DataConfig(clients=3, classes_per_client=2, input_size=16, scale=0.3))
    finals = {}
    for precision in ("float32", "bf16"):
        config = FleetConfig(model="linear-mobilenet_v1", width=0.25, kp=1, local_epochs=2, batch_size=32, lr=0.05,
                             engine=engine, precision=precision)
        shared, history = _run(config, data, torch.float32, 3)
        assert all(t.dtype in (torch.float32, torch.int64) for t in shared.values())
        assert history[-1]["mean_loss"] < history[0]["mean_loss"] / 2, (precision, history)
        finals[precision] = history[-1]["mean_accuracy"]
    assert finals["float32"] > 0.85  # chance is 0.5: the run learns, so the comparison means something
    assert abs(finals["bf16"] - finals["float32"]) <= 0.1, finals


def test_unknown_precision_is_refused(digits: FleetData) -> None:
    with pytest.raises(ValueError, match="unknown precision"):
        Fleet(FleetConfig(precision="fp8", **TINY), digits)
