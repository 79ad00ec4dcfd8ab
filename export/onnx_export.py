"""PyTorch -> ONNX -> onnxruntime-training artifact sets, following docs/onnxruntime-training.md.

One training-mode export serves everything: the artifact sets are generated from it, and the
inference model is the same graph with BatchNorm switched to eval mode. Its initializers are
overwritten from the PyTorch state_dict, because the export's forward pass shifts BN running stats.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import onnx
import torch
from onnx import numpy_helper

from fedper.artifacts import EVAL_MODEL, INPUT_NAME, LOGITS_NAME, MAX_IR_VERSION
from fedper.export.graph import rewrite_fast
from fedper.manifest import Manifest
from fedper.models import BlockNet

OPSET = 17


class ExportError(ValueError):
    """The export cannot produce artifacts that match the manifest."""


def torch_to_onnx(model: BlockNet, state: Mapping[str, torch.Tensor], manifest: Manifest) -> onnx.ModelProto:
    """Training-mode ONNX graph `input` -> `logits` whose initializers are exactly `state`, by manifest name,
    built with the ops of `manifest.graph` (fedper.export.graph)."""
    size = manifest.model.input_shape[1]
    clone = copy.deepcopy(model).train()
    if manifest.graph == "fast":
        rewrite_fast(clone, size)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation and num_batches_tracked notices
        torch.onnx.export(
            clone, (torch.zeros(2, 3, size, size),), buffer, dynamo=False,
            training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False, opset_version=OPSET,
            input_names=[INPUT_NAME], output_names=[LOGITS_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, LOGITS_NAME: {0: "batch"}},
        )
    proto = onnx.load_from_string(buffer.getvalue())
    if proto.ir_version > MAX_IR_VERSION:
        raise ExportError(f"onnx {onnx.__version__} wrote IR version {proto.ir_version}; "
                          f"onnxruntime 1.19 needs <= {MAX_IR_VERSION}")
    check_names(manifest, [init.name for init in proto.graph.initializer], "the torch export")
    for init in proto.graph.initializer:
        init.CopyFrom(numpy_helper.from_array(state[init.name].detach().cpu().numpy(), init.name))
    return proto


def check_names(manifest: Manifest, names: list[str], what: str) -> None:
    """Fail loudly if torch or ORT renamed, dropped or added a tensor: the manifest names are the contract."""
    expected = manifest.names()
    if sorted(names) != sorted(expected):
        extra = sorted(set(names) - set(expected))[:3]
        missing = sorted(set(expected) - set(names))[:3]
        raise ExportError(f"{what} does not carry the manifest's tensor names: extra {extra}, missing {missing}")


def batchnorm_to_eval(proto: onnx.ModelProto) -> None:
    """BatchNormalization with training_mode=0 and one output: ORT rejects eval-mode BN with 3 outputs."""
    for node in proto.graph.node:
        if node.op_type == "BatchNormalization":
            for attr in node.attribute:
                if attr.name == "training_mode":
                    attr.i = 0
            del node.output[1:]


def write_inference(training_proto: onnx.ModelProto, path: Path) -> None:
    """input -> logits with BN in eval mode, using the running statistics the graph carries."""
    proto = copy.deepcopy(training_proto)
    batchnorm_to_eval(proto)
    onnx.checker.check_model(proto)
    onnx.save(proto, path)


def write_artifact_set(training_proto: onnx.ModelProto, manifest: Manifest, kind: str, folder: Path) -> None:
    """ORT training artifacts that train the `kind` tensors ("all", "head", "base") and freeze the rest."""
    from onnxruntime.training import artifacts

    trained = manifest.trained_names(kind)
    frozen = [name for name in manifest.names() if name not in set(trained)]
    folder.mkdir(parents=True)
    with _native_stderr_quiet():
        artifacts.generate_artifacts(
            training_proto, requires_grad=trained, frozen_params=frozen,
            loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.SGD,
            artifact_directory=folder, additional_output_names=[LOGITS_NAME],
        )
    eval_path = folder / EVAL_MODEL
    eval_proto = onnx.load(eval_path)
    batchnorm_to_eval(eval_proto)
    onnx.save(eval_proto, eval_path)


def convert_to_ort(directory: Path) -> None:
    """.ort next to every .onnx under `directory` (ORT mobile), plus the required-operators config."""
    from onnxruntime.tools.convert_onnx_models_to_ort import OptimizationStyle, convert_onnx_models_to_ort

    with _native_stderr_quiet(), contextlib.redirect_stdout(io.StringIO()):
        convert_onnx_models_to_ort(directory, optimization_styles=[OptimizationStyle.Fixed])


@contextlib.contextmanager
def _native_stderr_quiet() -> Iterator[None]:
    """ORT's C++ graph builders log INFO lines straight to fd 2; keep them unless something fails."""
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            sink.seek(0)
            os.write(2, sink.read()[-4000:])
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
