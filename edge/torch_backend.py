"""Local training with PyTorch, for devices that have no onnxruntime-training build (Jetsons:
there is no linux-aarch64 wheel).

It builds the network with `fedper.models.build_model` from the manifest's model description:
the one exception to the rule that edge depends on the kernel only, imported lazily here so that
an ORT device never loads torch through it. The weights are the artifacts' own: every tensor is
read by name from inference.onnx (the manifest names equal the state_dict keys).

BatchNorm: onnxruntime-training updates running_var with the biased batch variance, PyTorch with
the unbiased one. The kernel's `DeferredOrtRunningVar` hook moves PyTorch's update onto ORT's, so
that both backends produce the same update from the same state and data.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from fedper.batches import DeferredOrtRunningVar
from fedper.edge.backend import TrainStats, evaluate_batches, run_epochs, trained_names
from fedper.manifest import Manifest, ManifestError

INFERENCE_FILE = "inference.onnx"


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


class TorchBackend:
    def __init__(self, artifacts: Path, manifest: Manifest) -> None:
        import torch

        from fedper.models import build_model  # the documented exception: see the module docstring

        m = manifest.model
        self.manifest = manifest
        self.model = build_model(m.architecture, m.num_classes, m.width, m.input_shape[1])
        self._tensors = {k: v for k, v in self.model.state_dict().items() if not k.endswith("num_batches_tracked")}
        unknown = sorted(set(self._tensors) ^ set(manifest.names()))
        if unknown:
            raise ManifestError(f"the model built from the manifest does not match its tensors: {unknown[:3]}")
        self._batchnorm = DeferredOrtRunningVar()  # flushed at the end of every train()
        for bn in self.model.modules():
            if isinstance(bn, torch.nn.modules.batchnorm._BatchNorm):
                bn.register_forward_pre_hook(self._batchnorm)
        self.load(inference_weights(artifacts, manifest))

    def load(self, tensors: Mapping[str, np.ndarray]) -> None:
        import torch

        with torch.no_grad():
            for name, value in tensors.items():
                self._tensors[name].copy_(torch.tensor(value))

    def read(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        return {name: self._tensors[name].detach().numpy().copy() for name in names}

    def train(
        self, trained: str, x: np.ndarray, y: np.ndarray, *, epochs: int, batch_size: int, lr: float,
        seed: int | Sequence[int],
    ) -> TrainStats:
        import torch
        import torch.nn.functional as F

        names = set(trained_names(self.manifest, trained))
        params = dict(self.model.named_parameters())
        for name, p in params.items():
            p.requires_grad_(name in names)
        optimizer = torch.optim.SGD([params[n] for n in params if n in names], lr=lr)
        self.model.train()
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)

        def step(idx: np.ndarray) -> float:
            optimizer.zero_grad(set_to_none=True)
            index = torch.from_numpy(idx)
            loss = F.cross_entropy(self.model(xt[index]), yt[index])
            loss.backward()
            optimizer.step()
            return loss.item()

        try:
            return run_epochs(step, len(y), epochs=epochs, batch_size=batch_size, seed=seed)
        finally:
            self._batchnorm.flush()

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        import torch
        import torch.nn.functional as F

        self.model.eval()

        def forward(xb: np.ndarray, yb: np.ndarray) -> tuple[float, np.ndarray]:
            with torch.no_grad():
                logits = self.model(torch.from_numpy(xb))
                return F.cross_entropy(logits, torch.from_numpy(yb)).item(), logits.numpy()

        return evaluate_batches(forward, x, y)
