"""export_artifacts: a model cut at K_P, written as everything a device and the coordinator need.

Everything is written into a temporary directory next to the output and renamed into place at
the end, so a failed or interrupted export leaves nothing half-written behind.
"""

from __future__ import annotations

import dataclasses
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from fedper.algorithms import federated_algorithm
from fedper.artifacts import BASE_FILE, INFERENCE_FILE, artifact_sets_for
from fedper.export.graph import GRAPHS
from fedper.export.onnx_export import ExportError, convert_to_ort, torch_to_onnx, write_artifact_set, write_inference
from fedper.manifest import Manifest, sha256_file
from fedper.models import build_model, describe, exported_state
from fedper.models.warm_start import warm_start
from fedper.payload import encode_shared

Progress = Callable[[str, int, int], None]  # (what is being done, steps done, steps in all)


def export_artifacts(
    out: Path,
    *,
    model: str,
    kp: int,
    num_classes: int,
    input_size: int,
    width: float = 1.0,
    algorithm: str = "fedper",
    seed: int = 0,
    classes: Sequence[str] = (),
    ort_format: bool = False,
    graph: str = "stock",
    bn: str = "shared",
    force: bool = False,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    init: Path | None = None,
    progress: Progress | None = None,
) -> Manifest:
    """Export and return the manifest written to `out`/manifest.json.

    `state_dict` exports given weights (e.g. a trained model) instead of the seeded initialization; `init` reads
    them from an untrusted checkpoint file (fedper.models.warm_start: torchvision's ResNet-34, this project's
    own state_dict, an emulator run), re-initializing the classifier for another class count, and the manifest's
    `weights` records the file's name and sha256;
    `graph` "fast" builds the graphs from ops ORT trains faster on CPU (fedper.export.graph); `bn` is the
    BatchNorm policy (fedper.manifest.BN_POLICIES), written in the manifest and built into the eval graphs.
    """
    out = Path(out)
    federated_algorithm(algorithm)  # an export is for a fleet: "local" shares nothing and is refused
    if graph not in GRAPHS:
        raise ExportError(f"unknown graph {graph!r}; choose one of {', '.join(GRAPHS)}")
    _check_output(out, force=force)
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG
        torch.manual_seed(seed)
        net = build_model(model, num_classes, width, input_size)
    if state_dict is not None and init is not None:
        raise ExportError("give the weights as a state_dict or as an init checkpoint, not both")
    weights: dict[str, object] = {"seed": seed} if state_dict is None else {"state_dict": "given to export_artifacts"}
    if init is not None:
        start = warm_start(init, net, model)  # CheckpointError (a ValueError) before anything is written
        state_dict, weights = start.state, {**start.record, "notes": list(start.notes)}
    if state_dict is not None:
        _load_weights(net, state_dict)
    manifest = dataclasses.replace(describe(
        net, architecture=model, kp=kp, algorithm=algorithm, input_size=input_size, width=width, classes=classes, bn=bn
    ), graph=graph, weights=weights)
    sets = artifact_sets_for(algorithm, kp)
    report = progress or (lambda what, done, total: None)
    total = 1 + len(sets) + int(ort_format)

    work = out.parent / f".{out.name}.{uuid.uuid4().hex[:8]}.partial"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        work.mkdir()
    except OSError as e:
        raise ExportError(f"cannot write the output directory {out}: {e.strerror or e}") from None
    try:
        report("exporting the PyTorch model to ONNX", 0, total)
        state = exported_state(net)
        training_proto = torch_to_onnx(net, state, manifest)
        write_inference(training_proto, work / INFERENCE_FILE, manifest.bn)
        shared = {name: state[name].detach().cpu().numpy() for name in manifest.names(shared=True)}
        (work / BASE_FILE).write_bytes(encode_shared(manifest, shared))
        for done, (kind, folder) in enumerate(sets.items(), start=1):
            report(f"building the '{kind}' training artifacts", done, total)
            write_artifact_set(training_proto, manifest, kind, work / folder)
        if ort_format:
            report("converting to ORT format", 1 + len(sets), total)
            convert_to_ort(work)
        files = {p.relative_to(work).as_posix(): sha256_file(p) for p in sorted(work.rglob("*")) if p.is_file()}
        manifest = dataclasses.replace(manifest, files=files, artifact_sets=sets)
        manifest.save(work)
        _move_into_place(work, out)
        report("done", total, total)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return manifest


def _check_output(out: Path, *, force: bool) -> None:
    """Refuse before any work is done: an existing file, or an existing non-empty directory without force."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"output {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"output directory {out} is not empty; pass --force to replace it")


def _load_weights(net: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    try:
        missing, unexpected = net.load_state_dict(dict(state_dict), strict=False)
    except RuntimeError as e:  # shape mismatches
        raise ExportError(f"state_dict does not fit the model: {str(e).splitlines()[-1].strip()}") from None
    missing = [name for name in missing if not name.endswith("num_batches_tracked")]
    if missing or unexpected:
        raise ExportError(f"state_dict does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")


def _move_into_place(work: Path, out: Path) -> None:
    """Rename the finished export to `out`; an old `out` (allowed by force) is removed only afterwards."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.{uuid.uuid4().hex[:8]}.old"
        out.rename(old)
    try:
        work.rename(out)
    except BaseException:
        if old is not None:
            old.rename(out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
