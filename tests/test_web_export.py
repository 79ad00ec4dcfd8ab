"""The export's graphs for the web agent (docs/onnxruntime-training.md, "The web agent's graphs"): a training graph
that takes the learning rate as an input, and an optimizer graph whose step flag is a true scalar. Run here in
Python onnxruntime-training, which must train exactly as before; web/test/ runs them in onnxruntime-web."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from fedper.artifacts import OPTIMIZER_MODEL, TRAINING_MODEL, WEB_LR_INPUT, WEB_TRAINING_MODEL
from fedper.manifest import Manifest, sha256_file
from fedper.verify import verify


def _batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((8, 3, 32, 32), dtype=np.float32), (np.arange(8) % 4).astype(np.int64)


def _step(set_dir: Path, training: str, optimizer: Path, *, lr: float, feed_lr: bool) -> tuple[float, np.ndarray]:
    """One SGD step from the set's checkpoint: (loss, every tensor after it as one vector). With `feed_lr` the
    rate goes in as the graph's input and the optimizer keeps the runtime's own rate, as in onnxruntime-web."""
    from onnxruntime.training import api

    state = api.CheckpointState.load_checkpoint(str(set_dir / "checkpoint"))
    module = api.Module(str(set_dir / training), state, str(set_dir / "eval_model.onnx"))
    opt = api.Optimizer(str(optimizer), module)
    x, y = _batch()
    if feed_lr:
        loss, _ = module(x, y, np.array(lr, np.float32))
    else:
        opt.set_learning_rate(lr)
        loss, _ = module(x, y)
    opt.step()
    return float(loss), module.get_contiguous_parameters(False).numpy().copy()


@pytest.mark.parametrize("lr", [0.05, 0.003])
def test_the_learning_rate_input_steps_like_set_learning_rate(tiny_export, lr):
    set_dir = tiny_export(algorithm="fedrep") / "train" / "base"
    start = _step(set_dir, TRAINING_MODEL, set_dir / OPTIMIZER_MODEL, lr=0.0, feed_lr=False)[1]
    loss, stock = _step(set_dir, TRAINING_MODEL, set_dir / OPTIMIZER_MODEL, lr=lr, feed_lr=False)
    web_loss, web = _step(set_dir, WEB_TRAINING_MODEL, set_dir / OPTIMIZER_MODEL, lr=lr, feed_lr=True)
    # the web graph's BatchNorm statistics are summed in float64, native onnxruntime's in float32 (relative error
    # 1e-7 to 3e-7): the loss and the step differ by that rounding carried through the network (measured: loss
    # 2e-7, step 1.1e-5 and 1.4e-5 of its norm at the two rates), not by anything the rate does
    assert abs(web_loss - loss) <= 1e-6 * abs(loss)
    step = stock - start
    assert np.linalg.norm(step) > 0
    assert np.linalg.norm(web - stock) <= 5e-5 * np.linalg.norm(step)


def _running_statistics(set_dir: Path, training: str | None) -> dict[str, np.ndarray]:
    """The set's BatchNorm running statistics from its checkpoint, after one training step of `training` (the
    web graph gets its rate as an input) or, with None, as the checkpoint holds them."""
    from onnxruntime.training import api

    state = api.CheckpointState.load_checkpoint(str(set_dir / "checkpoint"))
    if training is not None:
        module = api.Module(str(set_dir / training), state, str(set_dir / "eval_model.onnx"))
        x, y = _batch()
        module(x, y, np.array(0.05, np.float32)) if training == WEB_TRAINING_MODEL else module(x, y)
    return {name: p.data.copy() for name, p in state.parameters if name.endswith(("running_mean", "running_var"))}


def test_the_web_graph_sums_batchnorm_statistics_in_float64_and_keeps_the_running_statistics(tiny_export):
    """onnxruntime-web's BatchNorm kernel sums in sequential float32 (docs/onnxruntime-training.md): the web graph
    computes the statistics in float64 instead, and still updates the running statistics in the checkpoint state."""
    set_dir = tiny_export(algorithm="fedrep") / "train" / "base"
    stock, web = onnx.load(set_dir / TRAINING_MODEL).graph, onnx.load(set_dir / WEB_TRAINING_MODEL).graph
    kernels = [n for n in stock.node if n.op_type == "BatchNormInternal"]
    assert kernels and not any(n.op_type == "BatchNormInternal" for n in web.node)
    normalize = [n for n in web.node if n.op_type == "BatchNormalization"]
    assert [n.input[:3] for n in normalize] == [n.input[:3] for n in kernels]
    assert all(a.i == 0 for n in normalize for a in n.attribute if a.name == "training_mode")
    to_float64 = {n.input[0] for n in web.node if n.op_type == "Cast" and n.attribute[0].i == onnx.TensorProto.DOUBLE}
    assert {n.input[0] for n in kernels} <= to_float64
    # the same parameters in the same order (the page's getContiguousParameters), plus the rate
    assert [v.name for v in web.input] == [v.name for v in stock.input] + [WEB_LR_INPUT]
    assert [v.name for v in web.output] == [v.name for v in stock.output]

    start = _running_statistics(set_dir, None)
    after_stock = _running_statistics(set_dir, TRAINING_MODEL)
    after_web = _running_statistics(set_dir, WEB_TRAINING_MODEL)
    assert sorted(after_web) == sorted(after_stock)
    change = np.concatenate([after_stock[n] - start[n] for n in sorted(start)])
    gap = np.concatenate([after_web[n] - after_stock[n] for n in sorted(start)])
    assert np.linalg.norm(change) > 0
    assert np.linalg.norm(gap) <= 1e-6 * np.linalg.norm(change)  # measured 4e-7: float32 vs float64 batch sums


def _restore_shape_one_flag(optimizer: onnx.ModelProto) -> onnx.ModelProto:
    """The optimizer graph as generate_artifacts wrote it: the kernel's flag itself the output, declared [1]."""
    proto = onnx.ModelProto()
    proto.CopyFrom(optimizer)
    graph = proto.graph
    (output,) = graph.output
    kernel = next(n for n in graph.node if n.op_type == "SGDOptimizerV2")
    del graph.node[-2:]  # the Constant shape and the Reshape
    kernel.output[0] = output.name
    output.type.tensor_type.shape.dim.add().dim_value = 1
    return proto


def test_the_scalar_step_flag_trains_bit_for_bit_as_before_and_quietly(tiny_export, tmp_path):
    set_dir = tiny_export(algorithm="fedrep") / "train" / "base"
    fixed = onnx.load(set_dir / OPTIMIZER_MODEL)
    assert [len(o.type.tensor_type.shape.dim) for o in fixed.graph.output] == [0]
    original = tmp_path / "optimizer_as_generated.onnx"
    onnx.save(_restore_shape_one_flag(fixed), original)
    _, before = _step(set_dir, TRAINING_MODEL, original, lr=0.02, feed_lr=False)
    _, after = _step(set_dir, TRAINING_MODEL, set_dir / OPTIMIZER_MODEL, lr=0.02, feed_lr=False)
    np.testing.assert_array_equal(after, before)
    # onnxruntime logs natively to fd 2: once per load for the generated graph, at every step for a bare scalar
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from pathlib import Path; "
            f"import test_web_export as t; d = Path({str(set_dir)!r}); "
            f"[t._step(d, 'training_model.onnx', Path(sys.argv[1]), lr=0.02, feed_lr=False) for _ in range(2)]")
    logs = {path.name: subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                                      check=True).stderr for path in (original, set_dir / OPTIMIZER_MODEL)}
    assert "Error merging shape info" in logs[original.name]  # the check can see the line it looks for
    assert "update_completed" not in logs[OPTIMIZER_MODEL], logs[OPTIMIZER_MODEL]


def _rewrite(export: Path, name: str, proto: onnx.ModelProto) -> None:
    """Replace a file of the export and list its new sha256, so that only the graph check can object."""
    onnx.save(proto, export / name)
    body = json.loads((export / "manifest.json").read_text())
    body["files"][name] = sha256_file(export / name)
    (export / "manifest.json").write_text(json.dumps(body))


def test_verify_checks_the_web_graphs_and_accepts_an_export_made_before_them(tiny_export, tmp_path):
    source = tiny_export(algorithm="fedrep")
    assert verify(source) == []
    manifest = Manifest.load(source)
    web_files = [f"{folder}/{WEB_TRAINING_MODEL}" for folder in manifest.artifact_sets.values()]
    assert sorted(web_files) == sorted(n for n in manifest.files if n.endswith(WEB_TRAINING_MODEL))

    no_rate = tmp_path / "no-rate"
    shutil.copytree(source, no_rate)
    _rewrite(no_rate, web_files[0], onnx.load(no_rate / web_files[0].replace(WEB_TRAINING_MODEL, TRAINING_MODEL)))
    assert any(f"no float32 scalar input {WEB_LR_INPUT!r}" in p for p in verify(no_rate)), verify(no_rate)

    old_flag = tmp_path / "old-flag"
    shutil.copytree(source, old_flag)
    optimizer = "train/head/" + OPTIMIZER_MODEL
    _rewrite(old_flag, optimizer, _restore_shape_one_flag(onnx.load(old_flag / optimizer)))
    assert any("not one scalar: onnxruntime-web refuses it" in p for p in verify(old_flag)), verify(old_flag)

    missing = tmp_path / "missing"
    shutil.copytree(source, missing)
    (missing / web_files[1]).unlink()
    assert any(f"{web_files[1]}: listed in the manifest but missing" in p for p in verify(missing))

    before_web = tmp_path / "before-web"  # what fedper-export wrote before the web agent: still a sound export
    shutil.copytree(source, before_web)
    body = json.loads((before_web / "manifest.json").read_text())
    for name in web_files:
        (before_web / name).unlink()
        del body["files"][name]
    (before_web / "manifest.json").write_text(json.dumps(body))
    assert verify(before_web) == []
