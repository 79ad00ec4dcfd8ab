"""Warm start: a model's first weights from a checkpoint file, read as untrusted input.

Three kinds of file, told apart by their tensor names:
- torchvision's ResNet-34 state_dict as published (conv1.*, bn1.*, layerS.i.*, fc.*), mapped onto
  models/resnet.py's names (stem.0, stem.1, blocks.k, classifier): the BasicBlocks are torchvision's own;
- this project's own state_dict (a BlockNet's names), e.g. `torch.save(model.state_dict(), f)`, an
  agent's served.safetensors, or a safetensors file of those tensors;
- an emulator run directory R: `R/model.safetensors` (written by `save_weights` when the run ends), the
  run's shared tensors; its device-local ones (the clients' heads) are not in it and keep the model's
  seeded initialization.

Nothing is unpickled beyond tensors: safetensors, or torch.load(weights_only=True). Every tensor must
exist in the model with its shape (the classifier excepted: another class count re-initializes it),
be a finite float, and every tensor of the model must come from the file unless the file says it
holds none (device-local tensors). Anything else raises CheckpointError with one line naming what
does not match, before the caller writes anything.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedper.models.blocknet import BlockNet
from fedper.models.describe import exported_state
from fedper.models.resnet import STAGES

RUN_WEIGHTS = "model.safetensors"  # in an emulator run directory: the shared tensors of its final round
FORMAT = "fedper-weights"  # the metadata `save_weights` writes: its format name, architecture, device-local names
CLASSIFIER = ("classifier.weight", "classifier.bias")
_TORCHVISION_LAYER = re.compile(r"layer([1-4])\.(\d+)\.(.+)")
_TORCHVISION_TOP = {"conv1": "stem.0", "bn1": "stem.1", "fc": "classifier"}


class CheckpointError(ValueError):
    """A checkpoint that cannot start this model: the message is one line naming what does not match."""


@dataclass(frozen=True)
class WarmStart:
    state: dict[str, torch.Tensor]  # every exported tensor of the model, float32 on the CPU
    record: dict[str, str]  # where the weights came from: the manifest's `weights`
    notes: tuple[str, ...]  # what a person should know (classifier re-initialized, heads left seeded)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_weights(path: Path, tensors: Mapping[str, torch.Tensor], *, architecture: str, width: float,
                 input_size: int, classes: Sequence[str], device_local: Sequence[str]) -> None:
    """A run's shared tensors as a file `warm_start` reads (atomic, safetensors + JSON metadata); `device_local`
    names the model's tensors it does not hold."""
    from fedper import checkpoint

    meta = {"format": FORMAT, "architecture": architecture, "width": width, "input_size": input_size,
            "classes": list(classes), "device_local": list(device_local)}
    checkpoint.write_checkpoint(path, {n: t.detach().cpu().numpy() for n, t in tensors.items()}, meta)


def warm_start(path: str | Path, model: BlockNet, architecture: str) -> WarmStart:
    """The state to load into `model` (built with its seeded initialization) from the checkpoint at `path`."""
    file = _weights_file(Path(path))
    tensors, meta = _read(file)
    kind = "fedper"
    if meta.get("format") == FORMAT and meta.get("architecture") != architecture:
        raise CheckpointError(f"{path} holds a {meta.get('architecture')} (an emulator run's), the model is "
                              f"{architecture}")
    if _is_torchvision_resnet(tensors):
        if architecture != "resnet34":
            raise CheckpointError(f"{path} is a torchvision ResNet state_dict; the model is {architecture}")
        tensors, kind = _from_torchvision(tensors, path), "torchvision-resnet34"
    elif meta.get("format") == FORMAT:
        kind = "fedper-emulate"
    own = exported_state(model)
    notes = []
    classifier = _classifier(tensors, own, path)
    if classifier != "from the checkpoint":
        tensors = {n: v for n, v in tensors.items() if n not in CLASSIFIER}
    state = _matched(tensors, own, path, kind)
    missing = [n for n in own if n not in tensors and n not in CLASSIFIER]
    local = set(meta.get("device_local", ()))
    if missing and not local.issuperset(missing):
        absent = [n for n in missing if n not in local]
        raise CheckpointError(f"{path} lacks {len(absent)} of the {architecture}'s tensors, e.g. {absent[0]} "
                              f"(a file of another model, or cut short?)")
    if missing:
        notes.append(f"{len(missing)} device-local tensor(s) (the run's heads are its clients' own) start from "
                     "the seeded initialization")
    if classifier != "from the checkpoint":
        notes.append(f"classifier re-initialized: {classifier}")
    state.update({n: own[n].detach().cpu().clone() for n in own if n not in state})
    record = {"name": file.name if file == Path(path) else f"{Path(path).name}/{file.name}",
              "sha256": sha256_of(file), "format": kind, "classifier": classifier}
    return WarmStart(state, record, tuple(notes))


def _weights_file(path: Path) -> Path:
    if path.is_dir():
        inside = path / RUN_WEIGHTS
        if not inside.is_file():
            raise CheckpointError(f"{path} is a directory without {RUN_WEIGHTS} (a fedper-emulate run writes it "
                                  "when it finishes)")
        return inside
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    return path


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, metadata) of a safetensors file or of torch.save's zip of a dict of tensors (weights only)."""
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) == 9 and head[8:9] == b"{":  # safetensors: a u64 header length, then the JSON header
        return _read_safetensors(path)
    try:
        body = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any failure of an untrusted file is that file's problem, said in one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} is not a state_dict that loads without unpickling code (a safetensors "
                              f"file, or torch.save of a dict of tensors; truncated?): {first[:200]}") from None
    if not isinstance(body, Mapping) or not all(isinstance(v, torch.Tensor) for v in body.values()):
        raise CheckpointError(f"{path} holds a {type(body).__name__}, not a state_dict (a dict of tensors)")
    return {str(k): v for k, v in body.items()}, {}


def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    import json

    from safetensors import SafetensorError, safe_open

    from fedper.checkpoint import META_KEY

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
        meta = json.loads(metadata[META_KEY]) if META_KEY in metadata else {}
    except (SafetensorError, ValueError, OSError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file (truncated or corrupt?): {e}") from None
    return tensors, meta if isinstance(meta, dict) else {}


def _is_torchvision_resnet(tensors: Mapping[str, torch.Tensor]) -> bool:
    return {"conv1.weight", "fc.weight", "layer1.0.conv1.weight"} <= tensors.keys()


def _from_torchvision(tensors: Mapping[str, torch.Tensor], path: str | Path) -> dict[str, torch.Tensor]:
    """torchvision's ResNet names as models/resnet.py's: stem.0 = conv1, stem.1 = bn1, blocks.k = layerS.i in
    order, classifier = fc; the blocks inside are torchvision's BasicBlock, named alike."""
    counts = [1 + max((int(m[2]) for n in tensors if (m := _TORCHVISION_LAYER.fullmatch(n)) and m[1] == str(s)),
                      default=-1) for s in range(1, 5)]
    expected = [count for count, _, _ in STAGES]
    if counts != expected:
        raise CheckpointError(f"{path} is a ResNet with {counts} blocks per stage; ResNet-34 has {expected}")
    offsets = [sum(expected[:s]) for s in range(4)]
    mapped = {}
    for name, value in tensors.items():
        if name.endswith("num_batches_tracked"):
            continue
        top, _, rest = name.partition(".")
        if (m := _TORCHVISION_LAYER.fullmatch(name)) is not None:
            mapped[f"blocks.{offsets[int(m[1]) - 1] + int(m[2])}.{m[3]}"] = value
        else:
            mapped[f"{_TORCHVISION_TOP.get(top, top)}.{rest}"] = value
    return mapped


def _matched(tensors: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor], path: str | Path,
             kind: str) -> dict[str, torch.Tensor]:
    """The file's tensors that the model has, with its shapes, as float32; CheckpointError for any other."""
    tensors = {n: v for n, v in tensors.items() if not n.endswith("num_batches_tracked")}
    unknown = [n for n in tensors if n not in own]
    if unknown:
        raise CheckpointError(f"{path} holds {len(unknown)} tensor(s) the model has not, e.g. {unknown[0]} "
                              f"{list(tensors[unknown[0]].shape)} (a file of another model?)")
    state = {}
    for name, value in tensors.items():
        if value.shape != own[name].shape:
            hint = (": torchvision's ImageNet stem is a 7x7 convolution, export at --input-size above 64 "
                    "(e.g. 224) to use it") if kind.startswith("torchvision") and name == "stem.0.weight" else \
                " (another width multiplier or input size?)"
            raise CheckpointError(f"{path}: {name} is {list(value.shape)} in the file, {list(own[name].shape)} in "
                                  f"the model{hint}")
        if not value.is_floating_point():
            raise CheckpointError(f"{path}: {name} is {value.dtype}, not a float tensor")
        value = value.to(torch.float32)
        if not torch.isfinite(value).all():
            raise CheckpointError(f"{path}: {name} holds NaN or Inf")
        state[name] = value.clone()
    return state


def _classifier(tensors: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor], path: str | Path) -> str:
    """Whether the classifier comes from the file, or why it keeps the model's seeded initialization."""
    weight = tensors.get("classifier.weight")
    if weight is None:
        return "the checkpoint has none"
    if weight.dim() != 2:
        raise CheckpointError(f"{path}: classifier.weight is {list(weight.shape)}, not a matrix")
    if weight.shape[0] != own["classifier.weight"].shape[0]:
        if weight.shape[1:] != own["classifier.weight"].shape[1:]:
            raise CheckpointError(f"{path}: classifier.weight is {list(weight.shape)} in the file, "
                                  f"{list(own['classifier.weight'].shape)} in the model (another width multiplier?)")
        return f"the checkpoint has {weight.shape[0]} classes, the model {own['classifier.weight'].shape[0]}"
    return "from the checkpoint"
