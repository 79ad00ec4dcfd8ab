"""PyTorch -> ONNX -> onnxruntime-training artifact sets, following docs/onnxruntime-training.md.

One training-mode export serves everything: the artifact sets are generated from it, and the
inference model is the same graph with BatchNorm switched to eval mode (or, under the "batch"
BatchNorm policy, to batch statistics that write no running statistic). Its initializers are
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

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from fedper.artifacts import (
    EVAL_MODEL,
    INPUT_NAME,
    LOGITS_NAME,
    MAX_IR_VERSION,
    OPTIMIZER_MODEL,
    TRAINING_MODEL,
    WEB_LR_INPUT,
    WEB_TRAINING_MODEL,
)
from fedper.export.graph import rewrite_fast
from fedper.manifest import Manifest
from fedper.models import BlockNet

OPSET = 17
# onnxruntime-training's learning rate until something sets it (its C++ optimizer state's default). The web build
# cannot set it: the web training graph divides its learning_rate input by this, and the optimizer multiplies it back.
RUNTIME_LEARNING_RATE = 0.001


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
            _set_training_mode(node, 0)
            del node.output[1:]


def batchnorm_to_batch_statistics(proto: onnx.ModelProto) -> None:
    """Every BatchNormalization written out as the ops that normalize with each batch's own statistics
    (biased variance, as PyTorch's train mode) and read no running statistic: the "batch" BatchNorm
    policy. Not BatchNormalization in training mode: ORT's kernel then writes its running-statistics
    inputs in place, and in an inference session constant folding turns those into shared buffers, so
    repeated runs drift."""
    helper = onnx.helper
    nodes: list[onnx.NodeProto] = []
    for node in proto.graph.node:
        if node.op_type != "BatchNormalization":
            nodes.append(node)
            continue
        x, scale, bias = node.input[:3]
        epsilon = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
        t = f"{node.name}/batch_stats"  # a unique prefix for this layer's intermediate tensors
        nodes += [
            helper.make_node("ReduceMean", [x], [f"{t}/mean"], axes=[0, 2, 3], keepdims=1),
            helper.make_node("Sub", [x, f"{t}/mean"], [f"{t}/centered"]),
            helper.make_node("Mul", [f"{t}/centered", f"{t}/centered"], [f"{t}/squared"]),
            helper.make_node("ReduceMean", [f"{t}/squared"], [f"{t}/var"], axes=[0, 2, 3], keepdims=1),
            helper.make_node("Constant", [], [f"{t}/epsilon"], value=helper.make_tensor(
                f"{t}/epsilon_value", onnx.TensorProto.FLOAT, [], [epsilon])),
            helper.make_node("Add", [f"{t}/var", f"{t}/epsilon"], [f"{t}/var_eps"]),
            helper.make_node("Sqrt", [f"{t}/var_eps"], [f"{t}/std"]),
            helper.make_node("Div", [f"{t}/centered", f"{t}/std"], [f"{t}/normalized"]),
            helper.make_node("Constant", [], [f"{t}/channels"], value=helper.make_tensor(
                f"{t}/channels_value", onnx.TensorProto.INT64, [4], [1, -1, 1, 1])),
            helper.make_node("Reshape", [scale, f"{t}/channels"], [f"{t}/scale"]),
            helper.make_node("Reshape", [bias, f"{t}/channels"], [f"{t}/bias"]),
            helper.make_node("Mul", [f"{t}/normalized", f"{t}/scale"], [f"{t}/scaled"]),
            helper.make_node("Add", [f"{t}/scaled", f"{t}/bias"], [node.output[0]]),
        ]
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)


def serving_batchnorm(proto: onnx.ModelProto, bn: str) -> None:
    """BatchNorm as the device evaluates and serves under the BatchNorm policy `bn` (fedper.manifest):
    batch statistics under "batch", running statistics otherwise."""
    if bn == "batch":
        batchnorm_to_batch_statistics(proto)
    else:
        batchnorm_to_eval(proto)


def _set_training_mode(node: onnx.NodeProto, mode: int) -> None:
    for attr in node.attribute:
        if attr.name == "training_mode":
            attr.i = mode
            return
    node.attribute.append(onnx.helper.make_attribute("training_mode", mode))


def write_inference(training_proto: onnx.ModelProto, path: Path, bn: str = "shared") -> None:
    """input -> logits with BN as served under the BatchNorm policy `bn` (serving_batchnorm)."""
    proto = copy.deepcopy(training_proto)
    serving_batchnorm(proto, bn)
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
    serving_batchnorm(eval_proto, manifest.bn)
    onnx.save(eval_proto, eval_path)
    optimizer = onnx.load(folder / OPTIMIZER_MODEL)
    scalar_step_flag(optimizer)
    onnx.save(optimizer, folder / OPTIMIZER_MODEL)
    onnx.save(web_training_graph(onnx.load(folder / TRAINING_MODEL)), folder / WEB_TRAINING_MODEL)


def scalar_step_flag(optimizer: onnx.ModelProto) -> None:
    """The optimizer graph's one output, the SGD kernel's "update completed" flag, made a true scalar.

    generate_artifacts declares it shape [1] while the kernel's shape inference says scalar: onnxruntime-web refuses
    to load the graph ("inferred=0 declared=1"), Python logs "Error merging shape info" once per set. Declaring it a
    scalar alone trades that for a warning at every step (the kernel returns one element of shape [1]), so the flag
    goes through a Reshape to shape []: inferred, declared and returned shapes agree everywhere, and the optimizer
    only reads the flag as one boolean (scalar or [1] alike)."""
    graph = optimizer.graph
    (output,) = graph.output
    flag, shape = f"{output.name}/kernel", f"{output.name}/scalar_shape"
    for node in graph.node:
        node.output[:] = [flag if name == output.name else name for name in node.output]
    empty = onnx.helper.make_tensor(f"{shape}/value", onnx.TensorProto.INT64, [0], [])
    graph.node.extend([
        onnx.helper.make_node("Constant", [], [shape], value=empty),
        onnx.helper.make_node("Reshape", [flag, shape], [output.name]),
    ])
    del output.type.tensor_type.shape.dim[:]


def web_training_graph(training: onnx.ModelProto) -> onnx.ModelProto:
    """The training graph with the learning rate as a scalar float input, for onnxruntime-web (no setter there).

    The gradient graph starts from the loss's gradient, a constant 1.0 (`<loss>_grad`); here it is
    learning_rate / RUNTIME_LEARNING_RATE instead, so every gradient is scaled by it and the optimizer's fixed
    rate brings the step back to learning_rate x gradient. Any rate, per step, per set (FedBABU's decay too)."""
    proto = copy.deepcopy(training)
    graph = proto.graph
    seed = f"{graph.output[0].name}_grad"  # generate_artifacts' loss output comes first, its gradient seed is 1.0
    found = [i for i, init in enumerate(graph.initializer) if init.name == seed]
    if len(found) != 1 or numpy_helper.to_array(graph.initializer[found[0]]).tolist() != 1.0:
        raise ExportError(f"the training graph has no gradient seed {seed!r} of 1.0 to turn into a learning rate")
    del graph.initializer[found[0]]
    graph.input.append(onnx.helper.make_tensor_value_info(WEB_LR_INPUT, onnx.TensorProto.FLOAT, []))
    graph.node.insert(0, _scalar(f"{seed}/runtime_rate", onnx.TensorProto.FLOAT, RUNTIME_LEARNING_RATE))
    graph.node.insert(1, onnx.helper.make_node("Div", [WEB_LR_INPUT, f"{seed}/runtime_rate"], [seed]))
    float64_batchnorm_statistics(proto)
    return proto


def float64_batchnorm_statistics(training: onnx.ModelProto) -> None:
    """Every training-mode BatchNorm of a generated training graph with its batch statistics summed in float64.

    onnxruntime-web's BatchNorm kernel (com.microsoft BatchNormInternal, float only) sums each channel in one
    sequential float32 loop, 10-30 times less accurately than native onnxruntime's vectorized sums, enough to flip a
    ReLU and move a round's step by 1 % (docs/onnxruntime-training.md). Here the batch mean and biased variance come
    from the input cast to float64 (ReduceMean, ReduceSumSquare); the output is the inference-mode BatchNormalization
    with those statistics; BatchNormalizationGrad gets them as its saved mean and inverse standard deviation; and
    the running statistics are updated in place as the kernel did (running * momentum + batch * (1 - momentum), in
    float32) by InPlaceAccumulatorV2 with its overwrite flag set, the gradient accumulators' in-place op. The
    graph's inputs, outputs and parameters are unchanged."""
    helper = onnx.helper
    float32, float64 = onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE
    nodes: list[onnx.NodeProto] = []
    for node in training.graph.node:
        if node.op_type != "BatchNormInternal":
            nodes.append(node)
            continue
        x, scale, bias, running_mean, running_var = node.input
        y, _, _, saved_mean, saved_inv_std = node.output
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("training_mode", 1) != 1:
            raise ExportError(f"{node.name}: BatchNormInternal not in training mode in the training graph")
        epsilon, momentum = float(attrs.get("epsilon", 1e-5)), np.float32(attrs.get("momentum", 0.9))
        t = f"{node.name}/float64"

        nodes += [
            _scalar(f"{t}/epsilon", float64, epsilon),
            _scalar(f"{t}/one", float64, 1.0),
            helper.make_node("Cast", [x], [f"{t}/x"], to=float64),
            helper.make_node("ReduceMean", [f"{t}/x"], [f"{t}/mean"], axes=[0, 2, 3], keepdims=0),
            helper.make_node("ReduceSumSquare", [f"{t}/x"], [f"{t}/sum_squares"], axes=[0, 2, 3], keepdims=0),
            helper.make_node("Size", [x], [f"{t}/size"]),
            helper.make_node("Size", [scale], [f"{t}/channels"]),
            helper.make_node("Div", [f"{t}/size", f"{t}/channels"], [f"{t}/count_int"]),
            helper.make_node("Cast", [f"{t}/count_int"], [f"{t}/count"], to=float64),
            helper.make_node("Div", [f"{t}/sum_squares", f"{t}/count"], [f"{t}/mean_square"]),
            helper.make_node("Mul", [f"{t}/mean", f"{t}/mean"], [f"{t}/square_mean"]),
            helper.make_node("Sub", [f"{t}/mean_square", f"{t}/square_mean"], [f"{t}/var"]),  # biased, as ORT's
            helper.make_node("Add", [f"{t}/var", f"{t}/epsilon"], [f"{t}/var_epsilon"]),
            helper.make_node("Sqrt", [f"{t}/var_epsilon"], [f"{t}/std"]),
            helper.make_node("Div", [f"{t}/one", f"{t}/std"], [f"{t}/inv_std"]),
            helper.make_node("Cast", [f"{t}/mean"], [saved_mean], to=float32),
            helper.make_node("Cast", [f"{t}/var"], [f"{t}/var32"], to=float32),
            helper.make_node("Cast", [f"{t}/inv_std"], [saved_inv_std], to=float32),
            helper.make_node("BatchNormalization", [x, scale, bias, saved_mean, f"{t}/var32"], [y],
                             name=f"{t}/normalize", epsilon=epsilon, training_mode=0),
            helper.make_node("Constant", [], [f"{t}/overwrite"], value=helper.make_tensor(
                f"{t}/overwrite/value", onnx.TensorProto.BOOL, [1], [True])),
            _scalar(f"{t}/momentum", float32, float(momentum)),
            _scalar(f"{t}/rest", float32, float(np.float32(1.0 - momentum))),  # the kernel's float(1. - momentum)
        ]
        for stat, batch, running in (("mean", saved_mean, running_mean), ("var", f"{t}/var32", running_var)):
            nodes += [
                helper.make_node("Mul", [running, f"{t}/momentum"], [f"{t}/{stat}/kept"]),
                helper.make_node("Mul", [batch, f"{t}/rest"], [f"{t}/{stat}/new"]),
                helper.make_node("Add", [f"{t}/{stat}/kept", f"{t}/{stat}/new"], [f"{t}/{stat}/running"]),
                helper.make_node("InPlaceAccumulatorV2", [running, f"{t}/{stat}/running", f"{t}/overwrite"],
                                 [f"{t}/{stat}/updated"], name=f"{t}/update_running_{stat}", domain="com.microsoft"),
            ]
    del training.graph.node[:]
    training.graph.node.extend(nodes)


def _scalar(name: str, dtype: int, value: float) -> onnx.NodeProto:
    """A scalar Constant node of `dtype` whose output is `name`."""
    tensor = onnx.helper.make_tensor(f"{name}/value", dtype, [], [value])
    return onnx.helper.make_node("Constant", [], [name], value=tensor)


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
