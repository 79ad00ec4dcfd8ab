"""Local training with PyTorch, for devices that have no onnxruntime-training build (Jetsons:
there is no linux-aarch64 wheel).

It builds the network with `fedper.models.build_model` from the manifest's model description:
the one exception to the rule that edge depends on the kernel only, imported lazily here so that
an ORT device never loads torch through it. The weights are the artifacts' own: every tensor is
read by name from inference.onnx (the manifest names equal the state_dict keys).

Training is the kernel's (fedper.training, as in the emulator): the phase's tensors by plain SGD,
the rest frozen (their BatchNorm running statistics included, as the ORT backend restores them),
BatchNorm's running_var moved as onnxruntime-training moves it, so that both backends produce the
same update from the same state and data. It trains on CUDA where torch sees a GPU (--device auto, a
Jetson's), the same update to float32 rounding (tests/test_torch_cuda.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from fedper.artifacts import INFERENCE_FILE
from fedper.edge.backend import TrainStats, run_epochs
from fedper.manifest import Manifest, ManifestError


def inference_weights(artifacts: Path, manifest: Manifest) -> dict[str, np.ndarray]:
    """Every manifest tensor's initial value, read from the inference graph's initializers."""
    import onnx
    from onnx import numpy_helper

    proto = onnx.load(str(artifacts / INFERENCE_FILE))
    found = {init.name: numpy_helper.to_array(init) for init in proto.graph.initializer}
    missing = [n for n in manifest.names() if n not in found]
    if missing:
        raise ManifestError(f"{artifacts / INFERENCE_FILE} lacks {len(missing)} manifest tensors, e.g. {missing[:3]}")
    return {n: found[n] for n in manifest.names()}


DEVICES = ("auto", "cpu", "cuda")


def torch_device(device: str) -> tuple[str, str]:
    """("cpu" or "cuda", a few words saying where training runs) for --device auto, cpu or cuda; auto takes
    CUDA where torch sees a GPU (a Jetson's), else the CPU. ValueError in one line for cuda without one."""
    import torch

    if device not in DEVICES:
        raise ValueError(f"--device {device!r}: choose one of {', '.join(DEVICES)}")
    cuda = torch.cuda.is_available()
    if device == "cuda" and not cuda:
        raise ValueError("--device cuda: torch sees no CUDA GPU here (a CPU-only torch build, or no driver); use "
                         "--device cpu or auto")
    if device == "cpu" or not cuda:
        return "cpu", f"on the CPU (--device {device})"
    return "cuda", f"on CUDA, {torch.cuda.get_device_name(0)} (--device {device})"


class TorchBackend:
    def __init__(self, artifacts: Path, manifest: Manifest, device: str = "cpu") -> None:
        """`device`: "cpu" or "cuda" (torch_device resolves --device); the data moves there for each phase."""
        import torch

        from fedper.models import build_model, exported_state  # the documented exception: see the module docstring

        m = manifest.model
        self.manifest = manifest
        self.device = torch.device(device)
        if self.device.type == "cuda":  # float32 as on the CPU, not TF32's 10-bit mantissa in convolutions
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
        self.model = build_model(m.architecture, m.num_classes, m.width, m.input_shape[1]).to(self.device)
        self._tensors = exported_state(self.model)
        unknown = sorted(set(self._tensors) ^ set(manifest.names()))
        if unknown:
            raise ManifestError(f"the model built from the manifest does not match its tensors: {unknown[:3]}")
        self.load(inference_weights(artifacts, manifest))

    def load(self, tensors: Mapping[str, np.ndarray]) -> None:
        import torch

        with torch.no_grad():
            for name, value in tensors.items():
                self._tensors[name].copy_(torch.from_numpy(np.array(value, copy=True)))

    def read(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        return {name: self._tensors[name].detach().cpu().numpy().copy() for name in names}

    def train(
        self, trained: str, x: np.ndarray, y: np.ndarray, *, epochs: int, batch_size: int, lr: float,
        seed: int | Sequence[int],
    ) -> TrainStats:
        import torch

        from fedper.training import ort_batchnorm, phase_optimizer, sgd_step

        xt, yt = torch.from_numpy(x).to(self.device), torch.from_numpy(y).to(self.device)
        with ort_batchnorm(self.model):
            optimizer = phase_optimizer(self.model, self.manifest, trained, lr=lr)

            def step(idx: np.ndarray) -> float:
                index = torch.from_numpy(idx).to(self.device)
                return sgd_step(self.model, optimizer, xt[index], yt[index]).item()

            return run_epochs(step, len(y), epochs=epochs, batch_size=batch_size, seed=seed)

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        import torch

        from fedper.training import evaluate

        return evaluate(self.model, torch.from_numpy(x).to(self.device), torch.from_numpy(y).to(self.device),
                        batch_statistics=self.manifest.bn == "batch")  # as the "batch" export's eval graphs
