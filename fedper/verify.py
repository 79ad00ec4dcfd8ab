"""Check an export directory against its manifest, without torch or onnxruntime.

The agent and the coordinator call `verify` before they trust a directory; `fedper-export verify`
prints its findings. Only fedper's kernel, hashlib (through sha256_file), numpy and onnx are used.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path, PurePosixPath

import numpy as np
import onnx
from onnx import numpy_helper

from fedper.algorithms import get_algorithm
from fedper.artifacts import (
    BASE_FILE,
    EVAL_MODEL,
    INFERENCE_FILE,
    INPUT_NAME,
    LABELS_NAME,
    LOGITS_NAME,
    MAX_IR_VERSION,
    OPTIMIZER_MODEL,
    ORT_CONFIG_FILE,
    TRAINING_MODEL,
    WEB_LR_INPUT,
    WEB_TRAINING_MODEL,
    artifact_sets_for,
    expected_files,
)
from fedper.manifest import MANIFEST_FILE, Manifest, is_shared, sha256_file
from fedper.payload import PayloadError, decode_shared

GRAD_BUFFER_SUFFIX = "_grad.accumulation.buffer"  # generate_artifacts' gradient inputs, one per trained parameter
RESET_GRAD_INPUT = "lazy_reset_grad"


def verify(directory: str | Path, *, expected_digest: str | None = None) -> list[str]:
    """Every way `directory` disagrees with its manifest, one line each; an empty list means it is sound."""
    directory = Path(directory)
    try:
        manifest = Manifest.load(directory)
    except ValueError as e:  # ManifestError, or an unknown algorithm
        return [str(e)]
    problems: list[str] = []
    if expected_digest is not None and manifest.base_digest != expected_digest:
        problems.append(f"base_digest {manifest.base_digest} is not the expected {expected_digest}")
    problems += _check_roles(manifest)
    problems += _check_files(directory, manifest)
    if problems:
        return problems  # the ONNX checks below read files that must first be known intact
    initial = _check_inference(directory / INFERENCE_FILE, manifest, problems)
    web = _has_web_graphs(manifest)
    for kind, folder in manifest.artifact_sets.items():
        for graph in (TRAINING_MODEL, EVAL_MODEL, *([WEB_TRAINING_MODEL] if web else [])):
            _check_training_graph(directory / folder / graph, manifest, kind, problems)
        if web:
            _check_step_flag(directory / folder / OPTIMIZER_MODEL, problems)
    try:
        shared = decode_shared(manifest, (directory / BASE_FILE).read_bytes())
    except PayloadError as e:
        problems.append(f"{BASE_FILE}: {e}")
    else:
        changed = [name for name, value in shared.items() if not np.array_equal(value, initial.get(name))]
        if changed:
            problems.append(f"{BASE_FILE} differs from {INFERENCE_FILE}'s weights for {changed[:3]}")
    return problems


def summary(manifest: Manifest, directory: str | Path) -> str:
    """A few lines describing a (verified) export."""
    m = manifest.model
    counts = {role: sum(int(np.prod(t.shape)) for t in manifest.tensors if t.role == role and t.trainable)
              for role in ("base", "head")}
    size = sum((Path(directory) / name).stat().st_size for name in manifest.files) / 1e6
    return "\n".join([
        f"{m.architecture} width {m.width}, K_P={m.kp}, {m.num_classes} classes, input {list(m.input_shape)}",
        f"algorithm {manifest.algorithm}: shares the {get_algorithm(manifest.algorithm).shared_role}",
        f"parameters: base {counts['base']:,}, head {counts['head']:,}; {len(manifest.tensors)} tensors",
        f"artifact sets: {', '.join(f'{k} ({v})' for k, v in manifest.artifact_sets.items())}",
        f"{len(manifest.files)} files, {size:.1f} MB; base_digest {manifest.base_digest}",
    ])


def _check_roles(manifest: Manifest) -> list[str]:
    problems = []
    kp = manifest.model.kp
    for t in manifest.tensors:
        if t.role not in ("base", "head"):
            problems.append(f"tensor {t.name}: role {t.role!r} is neither base nor head")
        elif t.shared != is_shared(t.role, manifest.algorithm, batchnorm=t.batchnorm, bn=manifest.bn):
            problems.append(f"tensor {t.name}: shared={t.shared} but {manifest.algorithm} shares the "
                            f"{get_algorithm(manifest.algorithm).shared_role} (BatchNorm policy {manifest.bn})")
    has_head = any(t.role == "head" for t in manifest.tensors)
    if has_head != (kp > 0):
        problems.append(f"K_P={kp} but the manifest has {'some' if has_head else 'no'} head tensors")
    expected_sets = artifact_sets_for(manifest.algorithm, kp)
    if manifest.artifact_sets != expected_sets:
        problems.append(f"artifact_sets {manifest.artifact_sets}: {manifest.algorithm} needs {expected_sets}")
    return problems


def _check_files(directory: Path, manifest: Manifest) -> list[str]:
    problems = []
    for name, digest in manifest.files.items():
        path = PurePosixPath(name)
        if path.is_absolute() or ".." in path.parts:
            problems.append(f"files: {name!r} is not a path inside the export directory")
            continue
        if not (directory / name).is_file():
            problems.append(f"{name}: listed in the manifest but missing")
        elif sha256_file(directory / name) != digest:
            problems.append(f"{name}: sha256 does not match the manifest (modified or corrupt)")
    ort_format = ORT_CONFIG_FILE in manifest.files
    expected = set(expected_files(manifest.artifact_sets, ort_format=ort_format, web=_has_web_graphs(manifest)))
    for name in sorted(expected - set(manifest.files)):
        problems.append(f"{name}: needed by the manifest's artifact sets but not listed in its files")
    on_disk = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()} - {MANIFEST_FILE}
    for name in sorted(on_disk - set(manifest.files)):
        problems.append(f"{name}: unexpected file, not in the manifest")
    return problems


def _has_web_graphs(manifest: Manifest) -> bool:
    """Whether the export carries the web agent's graphs (exports made before them do not, and stay valid)."""
    return any(PurePosixPath(name).name == WEB_TRAINING_MODEL for name in manifest.files)


def _check_step_flag(path: Path, problems: list[str]) -> None:
    """onnxruntime-web loads an optimizer graph only if its output (the step flag) is declared a scalar."""
    proto = _load(path, problems)
    if proto is not None and [len(o.type.tensor_type.shape.dim) for o in proto.graph.output] != [0]:
        problems.append(f"{path.parent.name}/{path.name}: its output is not one scalar: onnxruntime-web refuses it")


def _graph_tensors(values: Iterable[onnx.ValueInfoProto | onnx.TensorProto]) -> dict[str, tuple[tuple, str]]:
    """name -> (shape, dtype) of initializers (TensorProto) or typed graph inputs (ValueInfoProto)."""
    out = {}
    for v in values:
        if isinstance(v, onnx.TensorProto):
            shape, elem = tuple(v.dims), v.data_type
        else:
            shape = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in v.type.tensor_type.shape.dim)
            elem = v.type.tensor_type.elem_type
        out[v.name] = (shape, onnx.helper.tensor_dtype_to_np_dtype(elem).name)
    return out


def _compare(found: dict[str, tuple[tuple, str]], manifest: Manifest, where: str, problems: list[str]) -> None:
    expected = {t.name: (t.shape, t.dtype) for t in manifest.tensors}
    for name in sorted(set(expected) - set(found))[:5]:
        problems.append(f"{where}: manifest tensor {name} is missing (renamed by the export?)")
    for name in sorted(set(found) - set(expected))[:5]:
        problems.append(f"{where}: tensor {name} is not in the manifest")
    for name in sorted(set(found) & set(expected)):
        if found[name] != expected[name]:
            shape, dtype = found[name]
            problems.append(f"{where}: {name} is {dtype}{list(shape)}, the manifest says "
                            f"{expected[name][1]}{list(expected[name][0])}")


def _load(path: Path, problems: list[str]) -> onnx.ModelProto | None:
    try:
        proto = onnx.load(path)
    except Exception as e:  # onnx raises protobuf's DecodeError and others
        problems.append(f"{path.name}: not a readable ONNX model: {e}")
        return None
    if proto.ir_version > MAX_IR_VERSION:
        problems.append(f"{path.name}: IR version {proto.ir_version} > {MAX_IR_VERSION}, onnxruntime 1.19 refuses it")
    return proto


def _check_inference(path: Path, manifest: Manifest, problems: list[str]) -> dict[str, np.ndarray]:
    """Compare the inference graph's weights with the manifest; return them for the base blob check."""
    proto = _load(path, problems)
    if proto is None:
        return {}
    _compare(_graph_tensors(proto.graph.initializer), manifest, INFERENCE_FILE, problems)
    _check_io(proto, [INPUT_NAME], manifest, INFERENCE_FILE, problems)
    return {init.name: numpy_helper.to_array(init) for init in proto.graph.initializer}


def _check_training_graph(path: Path, manifest: Manifest, kind: str, problems: list[str]) -> None:
    """In ORT training graphs the weights are graph inputs (the checkpoint holds their values)."""
    where = f"{path.parent.name}/{path.name}"
    proto = _load(path, problems)
    if proto is None:
        return
    inputs = [v for v in proto.graph.input if v.name not in (INPUT_NAME, LABELS_NAME, RESET_GRAD_INPUT, WEB_LR_INPUT)
              and not v.name.endswith(GRAD_BUFFER_SUFFIX)]
    _compare(_graph_tensors(inputs), manifest, where, problems)
    _check_io(proto, [INPUT_NAME, LABELS_NAME], manifest, where, problems)
    if path.name == WEB_TRAINING_MODEL and _graph_tensors(proto.graph.input).get(WEB_LR_INPUT) != ((), "float32"):
        problems.append(f"{where}: no float32 scalar input {WEB_LR_INPUT!r}")
    if path.name in (TRAINING_MODEL, WEB_TRAINING_MODEL):
        trained = sorted(v.name.removesuffix(GRAD_BUFFER_SUFFIX) for v in proto.graph.input
                         if v.name.endswith(GRAD_BUFFER_SUFFIX))
        expected = sorted(manifest.trained_names(kind))
        if trained != expected:
            problems.append(f"{where}: trains {len(trained)} tensors, a '{kind}' set must train {len(expected)}")


def _check_io(proto: onnx.ModelProto, inputs: list[str], manifest: Manifest, where: str, problems: list[str]) -> None:
    found = _graph_tensors(proto.graph.input)
    c, h, w = manifest.model.input_shape
    if INPUT_NAME not in found or found[INPUT_NAME][0][1:] != (c, h, w) or found[INPUT_NAME][1] != "float32":
        problems.append(f"{where}: input {INPUT_NAME!r} is {found.get(INPUT_NAME)}, not float32 [N, {c}, {h}, {w}]")
    if LABELS_NAME in inputs and found.get(LABELS_NAME, ((), ""))[1] != "int64":
        problems.append(f"{where}: no int64 {LABELS_NAME!r} input")
    outputs = {o.name for o in proto.graph.output}
    if LOGITS_NAME not in outputs:
        problems.append(f"{where}: no {LOGITS_NAME!r} output")
