"""The personal model: what the device serves (the round's base and its own head), as a model an app runs.

After every round (and after the last) the agent writes into its state directory

    personal.onnx   the export's inference.onnx (input -> logits, BatchNorm as served) with every weight
                    replaced by the device's: plain onnxruntime.InferenceSession runs it, no training runtime
    personal.json   what an app needs beside it: class names, input shape, preprocessing (RGB, bilinear
                    resize, 0..1, then (x - mean) / std per channel, NCHW float32), the round, the accuracy
                    measured on the device's test split and its chance line

each atomically (fedper.checkpoint: temporary file, fsync, rename) and mode 600 like the rest of the state (the
head is in it), the model first, so personal.json
never describes a model that is not there. `predict` classifies image files with it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedper import checkpoint
from fedper.artifacts import INFERENCE_FILE, INPUT_NAME
from fedper.edge import ort_import
from fedper.manifest import Manifest

PERSONAL_MODEL = "personal.onnx"
PERSONAL_INFO = "personal.json"
PREPROCESSING = ("RGB; resize to the input's height x width with Pillow's bilinear filter; scale to 0..1; "
                 "(x - mean) / std per channel; NCHW float32")


class PersonalModel:
    """Writes the personal model from the export's inference graph, whose initializers are the manifest's tensors."""

    def __init__(self, artifacts: Path, manifest: Manifest, classes: Sequence[str]) -> None:
        import onnx

        self.graph = onnx.load(str(artifacts / INFERENCE_FILE))
        self.manifest, self.classes = manifest, list(classes)

    def write(self, directory: Path, tensors: Mapping[str, np.ndarray], record: Mapping[str, Any]) -> None:
        """personal.onnx with `tensors` (every manifest tensor) as its weights, then personal.json with `record`."""
        from onnx import numpy_helper

        for init in self.graph.graph.initializer:
            init.CopyFrom(numpy_helper.from_array(np.asarray(tensors[init.name], np.float32), init.name))
        checkpoint.atomic_write(directory / PERSONAL_MODEL, self.graph.SerializeToString(), mode=checkpoint.PRIVATE)
        m = self.manifest.model
        info = {"model": PERSONAL_MODEL, "classes": self.classes, "input_shape": list(m.input_shape),
                "mean": list(m.mean), "std": list(m.std), "preprocessing": PREPROCESSING, **record}
        checkpoint.atomic_write(directory / PERSONAL_INFO, json.dumps(info, indent=2).encode(), mode=checkpoint.PRIVATE)


def preprocess(images: Sequence[Path], info: Mapping[str, Any]) -> np.ndarray:
    """Image files as the model's input, exactly as the agent reads its training images."""
    from fedper.data import read_image, to_float_nchw

    _, height, width = info["input_shape"]
    if height != width:
        raise ValueError(f"input {height}x{width}: the agent's loader resizes to squares only")
    return to_float_nchw(np.stack([read_image(p, height) for p in images]), info["mean"], info["std"])


def predict(state_dir: Path, images: Sequence[Path]) -> tuple[dict[str, Any], np.ndarray]:
    """(personal.json, logits of each image) from the personal model under plain onnxruntime.InferenceSession."""
    info_path = state_dir / PERSONAL_INFO
    if not info_path.is_file() or not (state_dir / PERSONAL_MODEL).is_file():
        raise ValueError(f"{state_dir} holds no personal model yet ({PERSONAL_MODEL}, {PERSONAL_INFO}): the agent "
                         "writes it after its first round")
    try:
        onnxruntime = ort_import.onnxruntime()
    except ImportError:
        raise ValueError("predict runs the model with onnxruntime, which is not installed here: pip install "
                         "onnxruntime") from None
    info = json.loads(info_path.read_text())
    session = onnxruntime.InferenceSession(str(state_dir / PERSONAL_MODEL), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {INPUT_NAME: preprocess(images, info)})
    return info, logits


def top_classes(logits: np.ndarray, classes: Sequence[str], k: int) -> list[list[tuple[str, float]]]:
    """Each row's k most probable classes with their softmax probability, most probable first."""
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    probabilities = shifted / shifted.sum(axis=1, keepdims=True)
    order = np.argsort(-probabilities, axis=1, kind="stable")[:, :k]
    return [[(classes[j], float(row[j])) for j in top] for row, top in zip(probabilities, order, strict=True)]
