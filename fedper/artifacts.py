"""What an export directory holds: file names, graph names, and the artifact sets an algorithm needs.

Shared by the exporter, the verifier and the agent's backends; imports neither torch nor onnxruntime.
"""

from __future__ import annotations

from fedper.algorithms import get_algorithm

INFERENCE_FILE = "inference.onnx"
BASE_FILE = "base.safetensors"
ORT_CONFIG_FILE = "required_operators.config"  # the operator list for a reduced ORT mobile build (--ort-format)
TRAINING_MODEL = "training_model.onnx"
EVAL_MODEL = "eval_model.onnx"
OPTIMIZER_MODEL = "optimizer_model.onnx"
CHECKPOINT_FILE = "checkpoint"  # the set's CheckpointState: every tensor, requires_grad baked in
# The web agent's training graph: training_model.onnx with the learning rate as an input (onnxruntime-web has no
# learning-rate setter; docs/onnxruntime-training.md). Exports made before it have none and still verify.
WEB_TRAINING_MODEL = "training_model.web.onnx"
WEB_LR_INPUT = "learning_rate"
SET_FILES = (TRAINING_MODEL, EVAL_MODEL, OPTIMIZER_MODEL, WEB_TRAINING_MODEL, CHECKPOINT_FILE)
SET_ORDER = ("all", "head", "base")
INPUT_NAME = "input"
LABELS_NAME = "labels"
LOGITS_NAME = "logits"
MAX_IR_VERSION = 10  # onnxruntime 1.19 refuses models of a newer ONNX IR version
# Where `pip install fedper-edge` brings onnxruntime-training (pyproject.toml's markers say the same)
ORT_WHEELS = "its last release, 1.19.2, has wheels for Linux x86-64 and macOS with Python 3.10-3.12 only"


def artifact_sets_for(algorithm: str, kp: int) -> dict[str, str]:
    """{"all": "train/all", ...}: one ORT training set per kind of phase the algorithm runs.

    FedBABU also fine-tunes a copy before evaluation (all of it by default, or its head), so it needs
    the `all` and the head-only sets too.
    """
    trained = set(get_algorithm(algorithm).trained_kinds)
    if kp == 0:
        trained &= {"all"}
    return {kind: f"train/{kind}" for kind in SET_ORDER if kind in trained}


def expected_files(artifact_sets: dict[str, str], *, ort_format: bool, web: bool = True) -> list[str]:
    """Every file an export writes besides manifest.json, as paths relative to the export directory;
    `web` False: an export made before the web agent's graphs."""
    onnx_files = [INFERENCE_FILE]
    other = [BASE_FILE]
    set_files = [name for name in SET_FILES if web or name != WEB_TRAINING_MODEL]
    for folder in artifact_sets.values():
        onnx_files += [f"{folder}/{name}" for name in set_files if name.endswith(".onnx")]
        other += [f"{folder}/{name}" for name in set_files if not name.endswith(".onnx")]
    ort = [name.removesuffix(".onnx") + ".ort" for name in onnx_files] + [ORT_CONFIG_FILE] if ort_format else []
    return sorted(onnx_files + other + ort)

