"""An export directory that `fedper.verify` accepts for a toy manifest of a few numbers (tests/vectors' tiny one):
ONNX graphs that declare the manifest's tensors where the exporter's do, no network behind them. The coordinator
verifies its export at start and never runs the graphs, so its process tests keep closed-form models of a few
numbers; an agent cannot train on it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fedper.artifacts import (
    BASE_FILE,
    CHECKPOINT_FILE,
    EVAL_MODEL,
    INFERENCE_FILE,
    INPUT_NAME,
    LABELS_NAME,
    LOGITS_NAME,
    OPTIMIZER_MODEL,
    TRAINING_MODEL,
    artifact_sets_for,
)
from fedper.manifest import Manifest, sha256_file
from fedper.payload import encode_shared
from fedper.verify import GRAD_BUFFER_SUFFIX, RESET_GRAD_INPUT


def write_toy_export(directory: Path, manifest: Manifest, initial: dict[str, np.ndarray]) -> Path:
    """`initial`: the shared tensors (base.safetensors and the inference graph's); head tensors are zeros."""
    directory.mkdir(parents=True, exist_ok=True)
    values = {t.name: np.asarray(initial[t.name], t.dtype) if t.name in initial else np.zeros(t.shape, t.dtype)
              for t in manifest.tensors}
    manifest = dataclasses.replace(manifest, artifact_sets=artifact_sets_for(manifest.algorithm, manifest.model.kp))
    c, h, w = manifest.model.input_shape
    images = helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["N", c, h, w])
    labels = helper.make_tensor_value_info(LABELS_NAME, TensorProto.INT64, ["N"])
    logits = helper.make_tensor_value_info(LOGITS_NAME, TensorProto.FLOAT, ["N", manifest.model.num_classes])
    weights = [numpy_helper.from_array(value, name) for name, value in values.items()]
    save(directory / INFERENCE_FILE, [images], weights, logits)
    as_inputs = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                 for name, v in values.items()]
    for kind, folder in manifest.artifact_sets.items():
        grads = [helper.make_tensor_value_info(name + GRAD_BUFFER_SUFFIX, TensorProto.FLOAT, values[name].shape)
                 for name in manifest.trained_names(kind)]
        reset = helper.make_tensor_value_info(RESET_GRAD_INPUT, TensorProto.BOOL, [])
        (directory / folder).mkdir(parents=True, exist_ok=True)
        save(directory / folder / TRAINING_MODEL, [images, labels, *as_inputs, *grads, reset], [], logits)
        save(directory / folder / EVAL_MODEL, [images, labels, *as_inputs], [], logits)
        save(directory / folder / OPTIMIZER_MODEL, [], [])
        (directory / folder / CHECKPOINT_FILE).write_bytes(b"toy")
    (directory / BASE_FILE).write_bytes(encode_shared(manifest, initial))
    files = {p.relative_to(directory).as_posix(): sha256_file(p) for p in sorted(directory.rglob("*")) if p.is_file()}
    dataclasses.replace(manifest, files=files).save(directory)
    return directory


def save(path: Path, inputs: list[onnx.ValueInfoProto], initializers: list[onnx.TensorProto],
         output: onnx.ValueInfoProto | None = None) -> None:
    """A graph declaring these inputs, initializers and `output` (the first input passed through)."""
    outputs, nodes = [], []
    if output is not None:
        outputs, nodes = [output], [helper.make_node("Identity", [INPUT_NAME], [output.name])]
    graph = helper.make_graph(nodes, path.stem, inputs, outputs, initializers)
    onnx.save(helper.make_model(graph, ir_version=10), path)
