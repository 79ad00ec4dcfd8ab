"""The torch backend on CUDA (a Jetson's GPU): the same update as on the CPU to float32 rounding.

Each device's update (two phases on the same batches, the agent's seeded order) is compared with the CPU's,
within a bound measured in the same test: how far the CPU's float32 update lies from the same training in
float64. On every machine the CPU half runs; where CUDA is present the GPU's too. The option itself:
--device cuda without a GPU, or with the ort backend, is one line; auto says where it trains in the agent's
first line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedper.data import load_digits, to_float_nchw
from fedper.edge.backend import check_artifacts
from fedper.edge.torch_backend import TorchBackend
from fedper.models import exported_state

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU on this machine: the CPU half of the comparison ran alone"))]


def train_twice(backend: TorchBackend, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """A head phase and a whole-model phase, one step of all 96 samples each, keyed as the agent keys round 1.
    One step each: this tiny model at its random start (8-channel BatchNorm layers, 2x2 maps at the end) is so
    ill-conditioned that float32 and float64 part by 2 % of the update after one step and by 100 % after three."""
    for index, trained in enumerate(("head", "all")):
        backend.train(trained, x, y, epochs=1, batch_size=96, lr=0.01, seed=(0, 1, index))
    return backend.read(backend.manifest.names())


@pytest.mark.parametrize("device", DEVICES)
def test_an_update_on_the_device_matches_the_cpus_to_float32_rounding(tiny_export, device) -> None:
    """What float32 rounding amounts to here is measured, not assumed: the CPU's float32 update against the
    same training in float64. The device's update must be as close to the CPU's (on the CPU itself: equal)."""
    artifacts = tiny_export(kp=2, algorithm="fedper-ft")
    manifest = check_artifacts(artifacts)
    digits = load_digits(image_size=32).train
    keep = digits.y < 4
    x = to_float_nchw(digits.x[keep][:96], manifest.model.mean, manifest.model.std)
    y = digits.y[keep][:96].astype(np.int64)

    start = TorchBackend(artifacts, manifest).read(manifest.names())
    cpu = train_twice(TorchBackend(artifacts, manifest), x, y)
    wide = TorchBackend(artifacts, manifest)
    wide.model.double()
    wide._tensors = exported_state(wide.model)  # the float64 tensors, for read()
    float64 = train_twice(wide, x.astype(np.float64), y)

    backend = TorchBackend(artifacts, manifest, device)
    assert all(t.device.type == device for t in backend.model.state_dict().values())
    got = train_twice(backend, x, y)
    for name in manifest.names():
        change = np.linalg.norm(float64[name] - start[name])
        if change == 0:
            assert np.array_equal(got[name], start[name]) and np.array_equal(cpu[name], start[name]), name
            continue
        rounding = np.linalg.norm(cpu[name] - float64[name])
        assert rounding < 0.05 * change + 1e-6, (name, rounding / change)  # a setting where rounding is small
        gap = np.linalg.norm(got[name] - cpu[name])
        assert gap <= 4 * rounding + 1e-6, (name, gap / change, rounding / change)
        if device == "cpu":
            assert np.array_equal(got[name], cpu[name]), name


def agent_first_line(artifacts: Path, tmp_path: Path, *options: str) -> subprocess.CompletedProcess[str]:
    """fedper-agent's answer (options after the defaults win)."""
    return subprocess.run(
        [sys.executable, "-m", "fedper.edge.cli", "--artifacts", str(artifacts), "--data", str(tmp_path / "none"),
         "--broker", "mqtt://127.0.0.1:9", "--fleet", "f", "--client-id", "d", "--state-dir", str(tmp_path / "s"),
         *options], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a machine without a CUDA GPU")
def test_device_option_without_a_gpu(tiny_artifacts, tmp_path) -> None:
    data = tmp_path / "data.npz"
    data.write_bytes(b"not an npz: the agent stops there, after its first line")
    common = ["--data", str(data)]
    cuda = agent_first_line(tiny_artifacts, tmp_path, "--backend", "torch", "--device", "cuda", *common)
    assert cuda.returncode == 2 and cuda.stderr.strip() == (
        "fedper-agent: --device cuda: torch sees no CUDA GPU here (a CPU-only torch build, or no driver); use "
        "--device cpu or auto"), cuda.stderr
    ort = agent_first_line(tiny_artifacts, tmp_path, "--backend", "ort", "--device", "cuda", *common)
    assert ort.returncode == 2 and "--device cuda trains with the torch backend" in ort.stderr, ort.stderr
    auto = agent_first_line(tiny_artifacts, tmp_path, "--backend", "torch", *common)
    assert auto.returncode == 2, auto.stderr
    first = auto.stderr.splitlines()[0]
    assert first.startswith("fedper-agent: training with torch ") and first.endswith("on the CPU (--device auto)")
