"""Local training with onnxruntime-training over the exported artifact sets.

One CheckpointState + Module + Optimizer per artifact set ("all", "head", "base"): requires_grad
is baked into a checkpoint, so freezing means switching sets (docs/onnxruntime-training.md). The
set trained last holds the current tensors; switching copies every manifest tensor into the next
set by name.

A training graph runs every BatchNorm node in training mode, so a head-only graph also moves the
running statistics of the frozen base. A frozen layer keeps its statistics (fedper.training's rule,
which the torch backend and the emulator follow): they are read before a phase and written back
after it, while the forward pass normalized with the batch's statistics, as PyTorch's does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedper.algorithms import check_trained
from fedper.artifacts import CHECKPOINT_FILE, EVAL_MODEL, OPTIMIZER_MODEL, TRAINING_MODEL
from fedper.edge.backend import TrainStats, evaluate_batches, run_epochs
from fedper.edge.ort_import import training_api
from fedper.manifest import Manifest, ManifestError


@dataclass
class _ArtifactSet:
    state: Any  # onnxruntime.training.api.CheckpointState
    module: Any  # onnxruntime.training.api.Module
    optimizer: Any  # onnxruntime.training.api.Optimizer


def _model_file(directory: Path, name: str) -> str:
    """The .onnx file `name`, or the .ort one that `fedper-export --ort-format` writes for mobile builds."""
    for path in (directory / name, (directory / name).with_suffix(".ort")):
        if path.is_file():
            return str(path)
    raise ManifestError(f"{directory} has no {name} or {Path(name).with_suffix('.ort')}")


class OrtBackend:
    def __init__(self, artifacts: Path, manifest: Manifest) -> None:
        api = training_api()
        if not manifest.artifact_sets:
            raise ManifestError(f"{artifacts}: the manifest lists no training artifact sets")
        self.manifest = manifest
        self._names = manifest.names()
        self._sets: dict[str, _ArtifactSet] = {}
        for trained, folder in manifest.artifact_sets.items():
            d = artifacts / folder
            state = api.CheckpointState.load_checkpoint(str(d / CHECKPOINT_FILE))
            # The Module comes first: writing parameters on a state that has no Module yet segfaults.
            module = api.Module(_model_file(d, TRAINING_MODEL), state, _model_file(d, EVAL_MODEL), device="cpu")
            optimizer = api.Optimizer(_model_file(d, OPTIMIZER_MODEL), module)
            missing = [n for n in self._names if n not in state.parameters]
            if missing:
                raise ManifestError(f"{d}/checkpoint lacks {len(missing)} manifest tensors, e.g. {missing[:3]}")
            self._sets[trained] = _ArtifactSet(state, module, optimizer)
        self._current = "all" if "all" in self._sets else next(iter(self._sets))

    def load(self, tensors: Mapping[str, np.ndarray]) -> None:
        for artifact_set in self._sets.values():
            params = artifact_set.state.parameters
            for name, value in tensors.items():
                np.copyto(params[name].data, value)

    def read(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        params = self._sets[self._current].state.parameters
        return {name: np.array(params[name].data, copy=True) for name in names}

    def _switch(self, trained: str) -> _ArtifactSet:
        """Make `trained`'s set current, carrying every tensor over from the set that was."""
        if trained not in self._sets:
            raise ManifestError(
                f"the artifacts have no set training {trained!r} (they have {', '.join(self._sets)}); "
                f"re-export for algorithm {self.manifest.algorithm}"
            )
        if trained != self._current:
            tensors = self.read(self._names)
            params = self._sets[trained].state.parameters
            for name, value in tensors.items():
                np.copyto(params[name].data, value)
            self._current = trained
        return self._sets[trained]

    def train(
        self, trained: str, x: np.ndarray, y: np.ndarray, *, epochs: int, batch_size: int, lr: float,
        seed: int | Sequence[int],
    ) -> TrainStats:
        check_trained(trained)
        s = self._switch(trained)
        s.optimizer.set_learning_rate(lr)
        s.module.train()
        kept = self.read(self.frozen_statistics(trained))

        def step(idx: np.ndarray) -> float:
            loss, _ = s.module(x[idx], y[idx])
            s.optimizer.step()
            s.module.lazy_reset_grad()
            return loss

        stats = run_epochs(step, len(y), epochs=epochs, batch_size=batch_size, seed=seed)
        self.load(kept)
        return stats

    def frozen_statistics(self, trained: str) -> list[str]:
        """The BatchNorm running statistics of the layers a phase training `trained` freezes."""
        return [t.name for t in self.manifest.tensors if not t.trainable and trained not in ("all", t.role)]

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        module = self._sets[self._current].module
        module.eval()
        return evaluate_batches(module, x, y)
