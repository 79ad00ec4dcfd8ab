"""What a local-training backend does, and the pieces both backends share.

A backend holds the device's whole model (shared + device-local tensors, by manifest name) and
trains the set of tensors a phase names ("all", "head" or "base"). Two implementations:
`ort_backend.OrtBackend` (onnxruntime-training, the artifacts' own graphs) and
`torch_backend.TorchBackend` (PyTorch, for devices without an onnxruntime-training build).
`choose_backend` picks one for `--backend auto`. Both walk the kernel's seeded batch order
(fedper.batches), so from the same state and data they make the same update, and the same one as the emulator.
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Protocol

import numpy as np

from fedper.artifacts import ORT_WHEELS
from fedper.batches import EVAL_BATCH, epoch_batches
from fedper.edge.ort_import import training_api
from fedper.manifest import Manifest, ManifestError
from fedper.verify import verify

BACKENDS = ("auto", "ort", "torch")


class BackendUnavailable(ValueError):
    """A --backend whose runtime this device cannot import: a bad option value here, reported as one."""


def _version(load: Callable[[], ModuleType], package: str) -> str | None:
    """`package`'s version when `load` imports it, else None: a real import, not a lookup, so that a runtime
    that is present but cannot load counts as missing (the backend imports it next anyway)."""
    try:
        load()
    except ImportError:
        return None
    return str(getattr(sys.modules[package], "__version__", "?"))


def choose_backend(kind: str) -> tuple[str, str]:
    """('ort' or 'torch', a line saying which runtime trains and why) for --backend auto, ort or torch;
    BackendUnavailable with one line (what is missing, what to do) when the runtime asked for is not installed."""
    if kind not in BACKENDS:
        raise ValueError(f"--backend {kind!r}: choose one of {', '.join(BACKENDS)}")
    if kind in ("auto", "ort"):
        ort = _version(training_api, "onnxruntime")
        if ort is not None:
            return "ort", f"training with onnxruntime-training {ort} (--backend {kind})"
        if kind == "ort":
            raise BackendUnavailable(f"--backend ort: onnxruntime-training is not installed ({ORT_WHEELS}); use "
                                     "--backend torch (or auto), or build onnxruntime with its training APIs "
                                     "(deploy/README.md)")
    torch = _version(lambda: importlib.import_module("torch"), "torch")
    if torch is not None:
        why = ": onnxruntime-training is not installed" if kind == "auto" else ""
        return "torch", f"training with torch {torch} (--backend {kind}{why})"
    missing = "neither onnxruntime-training nor torch is installed" if kind == "auto" else "torch is not installed"
    raise BackendUnavailable(f"--backend {kind}: {missing}; install PyTorch for this device (deploy/README.md)")


def batch_order(n: int, batch_size: int, epoch: int, seed: int | Sequence[int]) -> list[np.ndarray]:
    """One epoch's batches, keyed (*seed, epoch): the agent passes (its --seed, round, phase index),
    so the key is the kernel's (client_seed, round, phase_index, epoch) and the emulator draws the
    same batches (fedper.batches)."""
    return epoch_batches(n, batch_size, [*np.atleast_1d(seed).tolist(), epoch])


@dataclass(frozen=True)
class TrainStats:
    samples: int  # samples seen (sum of batch sizes over all epochs)
    seconds: float
    loss: float  # mean training loss over the batches

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0


class Backend(Protocol):
    def load(self, tensors: Mapping[str, np.ndarray]) -> None:
        """Overwrite the named tensors (any subset of the manifest's) in place."""

    def read(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        """Copies of the named tensors as they are now."""

    def train(
        self, trained: str, x: np.ndarray, y: np.ndarray, *, epochs: int, batch_size: int, lr: float,
        seed: int | Sequence[int],
    ) -> TrainStats:
        """Plain SGD on the `trained` tensors ("all", "head" or "base") over batch_order's batches;
        `seed` is (client_seed, round, phase index), the agent's --seed being its client_seed."""

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """(accuracy, mean loss) of the model as it is now, in inference mode."""


def run_epochs(
    step, n: int, *, epochs: int, batch_size: int, seed: int | Sequence[int]
) -> TrainStats:
    """Drive `step(batch_indices) -> loss` over every epoch's batches and time it."""
    start, samples, losses = time.perf_counter(), 0, []
    for epoch in range(epochs):
        for idx in batch_order(n, batch_size, epoch, seed):
            losses.append(float(step(idx)))
            samples += len(idx)
    return TrainStats(samples, time.perf_counter() - start, float(np.mean(losses)) if losses else float("nan"))


def check_artifacts(directory: str | Path) -> Manifest:
    """Load the manifest and check every file against it (checksums, names, digest) before any use."""
    directory = Path(directory)
    manifest = Manifest.load(directory)
    problems = verify(directory)
    if problems:
        raise ManifestError(f"{directory} does not match its manifest: " + "; ".join(problems[:5]))
    return manifest


def open_backend(kind: str, artifacts: str | Path, manifest: Manifest, device: str = "cpu") -> Backend:
    """Backends import their runtime lazily: a device needs only the one it uses. `device` ("cpu" or "cuda",
    resolved by torch_backend.torch_device) is where the torch backend trains; the ORT one trains on the CPU."""
    if kind == "ort":
        from fedper.edge.ort_backend import OrtBackend

        return OrtBackend(Path(artifacts), manifest)
    if kind == "torch":
        from fedper.edge.torch_backend import TorchBackend

        return TorchBackend(Path(artifacts), manifest, device)
    raise ValueError(f"unknown backend {kind!r}; choose ort or torch (choose_backend resolves auto)")


def evaluate_batches(forward, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Accuracy and mean loss from `forward(x, y) -> (loss, logits)` over fixed-size chunks."""
    if len(y) == 0:
        return float("nan"), float("nan")
    correct, loss_sum = 0, 0.0
    for i in range(0, len(y), EVAL_BATCH):
        xb, yb = x[i : i + EVAL_BATCH], y[i : i + EVAL_BATCH]
        loss, logits = forward(xb, yb)
        correct += int((np.asarray(logits).argmax(1) == yb).sum())
        loss_sum += float(loss) * len(yb)
    return correct / len(y), loss_sum / len(y)
