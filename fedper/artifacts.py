"""What an export directory holds: file names and the artifact sets an algorithm needs.

Shared by the exporter and the verifier; imports neither torch nor onnxruntime.
"""

from __future__ import annotations

from collections.abc import Iterable

from fedper.algorithms import get_algorithm
from fedper.manifest import TensorSpec

INFERENCE_FILE = "inference.onnx"
BASE_FILE = "base.safetensors"
ORT_CONFIG_FILE = "required_operators.config"  # the operator list for a reduced ORT mobile build (--ort-format)
SET_FILES = ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint")
SET_ORDER = ("all", "head", "base")
INPUT_NAME = "input"
LABELS_NAME = "labels"
LOGITS_NAME = "logits"


def artifact_sets_for(algorithm: str, kp: int) -> dict[str, str]:
    """{"all": "train/all", ...}: one ORT training set per kind of phase the algorithm runs.

    FedBABU also fine-tunes the head before evaluation, so it needs a head-only set too.
    """
    algo = get_algorithm(algorithm)
    trained = {phase.trained for phase in algo.phases}
    if algo.fine_tune_head_at_eval:
        trained.add("head")
    if kp == 0:
        trained &= {"all"}
    return {kind: f"train/{kind}" for kind in SET_ORDER if kind in trained}


def expected_files(artifact_sets: dict[str, str], *, ort_format: bool) -> list[str]:
    """Every file an export writes besides manifest.json, as paths relative to the export directory."""
    onnx_files = [INFERENCE_FILE]
    other = [BASE_FILE]
    for folder in artifact_sets.values():
        onnx_files += [f"{folder}/{name}" for name in SET_FILES if name.endswith(".onnx")]
        other += [f"{folder}/{name}" for name in SET_FILES if not name.endswith(".onnx")]
    ort = [name.removesuffix(".onnx") + ".ort" for name in onnx_files] + [ORT_CONFIG_FILE] if ort_format else []
    return sorted(onnx_files + other + ort)


def trained_names(tensors: Iterable[TensorSpec], kind: str) -> list[str]:
    """Parameters a set of `kind` ("all", "head", "base") trains; everything else in it is frozen."""
    return [t.name for t in tensors if t.trainable and kind in ("all", t.role)]
