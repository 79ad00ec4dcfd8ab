"""The manifest: the base/head split decided in models/ and written down once, in manifest.json.

The exporter writes it; the agent, the coordinator, the codec and the emulator read it. The
`shared` flag of each tensor is what may ever be serialized for the wire: it is derived here,
once, from the tensor's role, the algorithm's shared role and the BatchNorm policy.

The BatchNorm policy (`bn`) says what a device does with its BatchNorm layers:
- "shared": their affine parameters and running statistics follow their layer's role (the base's are
  averaged like any base tensor);
- "local" (FedBN, Li et al. 2021): every BatchNorm tensor stays on the device, whatever its layer's
  role, so it is never serialized;
- "batch" (FedBABU's evaluation, Oh et al. 2022): shared as under "shared", but a device evaluates
  and serves with the statistics of the batch it classifies, its running statistics left untouched.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from fedper.algorithms import Trained, check_trained, get_algorithm

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
BN_POLICIES = ("shared", "local", "batch")
SummedTensors = Literal["shared", "trainable"]  # which shared tensors a secure or private sum covers


class ManifestError(ValueError):
    """A manifest that is missing, malformed, or does not match what it describes."""


@dataclass(frozen=True)
class TensorSpec:
    name: str  # the ONNX initializer name, equal to the PyTorch state_dict key
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name, e.g. "float32"
    role: str  # "base" or "head"
    trainable: bool  # parameters True; BatchNorm running statistics False
    shared: bool  # aggregated and sent on the wire under this manifest's algorithm and BatchNorm policy
    batchnorm: bool = False  # a BatchNorm layer's (affine parameter or running statistic): `bn` decides its sharing


@dataclass(frozen=True)
class ModelInfo:
    architecture: str
    kp: int
    num_classes: int
    input_shape: tuple[int, int, int]  # C, H, W
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    width: float = 1.0
    classes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Manifest:
    model: ModelInfo
    algorithm: str
    tensors: tuple[TensorSpec, ...]
    versions: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # relative path -> sha256
    # ORT training artifact sets by what they train ("all", "head", "base") -> folder relative to the manifest
    artifact_sets: dict[str, str] = field(default_factory=dict)
    # the ops the graphs were built with: "stock" (torch.onnx's) or "fast" (fedper.export.graph); same tensors
    graph: str = "stock"
    bn: str = "shared"  # the BatchNorm policy, one of BN_POLICIES (see the module docstring)
    # where the export's weights came from: {"seed": N}, or a checkpoint's name, sha256, format, classifier, notes
    weights: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def names(self, role: str | None = None, *, shared: bool | None = None) -> list[str]:
        return [
            t.name
            for t in self.tensors
            if (role is None or t.role == role) and (shared is None or t.shared == shared)
        ]

    def trained_names(self, trained: Trained) -> list[str]:
        """The trainable tensors a phase training `trained` updates by gradient; every other tensor
        is frozen (BatchNorm statistics are never trained, they follow the data)."""
        check_trained(trained)
        return [t.name for t in self.tensors if t.trainable and trained in ("all", t.role)]

    def spec(self, name: str) -> TensorSpec:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    @property
    def shared_tensors(self) -> tuple[TensorSpec, ...]:
        return tuple(t for t in self.tensors if t.shared)

    def summed_tensors(self, which: SummedTensors = "shared") -> tuple[TensorSpec, ...]:
        """The tensors a sum covers, in manifest order: every shared one, or the trainable shared ones, those DP
        clips and noises (BatchNorm statistics are not gradients: docs/privacy.md). The coordinator, the device
        and fedper.privacy all ask here, so they never disagree on the vector's layout."""
        if which not in get_args(SummedTensors):
            raise ValueError(f"summed tensors {which!r}: choose one of {', '.join(get_args(SummedTensors))}")
        return tuple(t for t in self.shared_tensors if which == "shared" or t.trainable)

    @property
    def base_digest(self) -> str:
        """Digest of the shared layout (names, shapes, dtypes in order): peers refuse to mix layouts."""
        return layout_digest(self.shared_tensors)

    def to_json(self) -> str:
        body = asdict(self)
        if not self.weights:  # a manifest that no export wrote (the emulator's, the test vectors') says nothing
            del body["weights"]
        body["base_digest"] = self.base_digest
        return json.dumps(body, indent=2, sort_keys=False) + "\n"

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / MANIFEST_FILE
        path.write_text(self.to_json())
        return path

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> Manifest:
        try:
            if body.get("format_version") != FORMAT_VERSION:
                raise ManifestError(
                    f"manifest format_version {body.get('format_version')!r} is not {FORMAT_VERSION}"
                )
            m = body["model"]
            model = ModelInfo(
                **{**m, "input_shape": tuple(m["input_shape"]), "mean": tuple(m["mean"]),
                   "std": tuple(m["std"]), "classes": tuple(m.get("classes", ()))}
            )
            tensors = tuple(TensorSpec(**{**t, "shape": tuple(t["shape"])}) for t in body["tensors"])
            manifest = cls(
                model=model, algorithm=body["algorithm"], tensors=tensors,
                versions=dict(body.get("versions", {})), files=dict(body.get("files", {})),
                artifact_sets=dict(body.get("artifact_sets", {})), graph=str(body.get("graph", "stock")),
                bn=str(body.get("bn", "shared")), weights=dict(body.get("weights", {})),
            )
        except (KeyError, TypeError) as e:
            raise ManifestError(f"malformed manifest: {type(e).__name__}: {e}") from None
        try:
            get_algorithm(manifest.algorithm)
            check_bn(manifest.bn)
        except ValueError as e:
            raise ManifestError(str(e)) from None
        stated = body.get("base_digest")
        if stated is not None and stated != manifest.base_digest:
            raise ManifestError(f"manifest base_digest {stated} does not match its tensors ({manifest.base_digest})")
        return manifest

    @classmethod
    def load(cls, directory: str | Path) -> Manifest:
        path = Path(directory) / MANIFEST_FILE
        try:
            body = json.loads(path.read_text())
        except (FileNotFoundError, NotADirectoryError):
            where = Path(directory)
            why = "is it an export directory?" if where.is_dir() else \
                f"{where} {'is a file' if where.exists() else 'does not exist'}"
            raise ManifestError(f"no {MANIFEST_FILE} in {directory}: {why}") from None
        except json.JSONDecodeError as e:
            raise ManifestError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(body)


def layout_digest(tensors: tuple[TensorSpec, ...] | list[TensorSpec]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(f"{t.name}:{','.join(map(str, t.shape))}:{t.dtype}\n".encode())
    return "sha256:" + h.hexdigest()


def check_bn(bn: str) -> str:
    """The BatchNorm policy, refused unless it is one of BN_POLICIES."""
    if bn not in BN_POLICIES:
        raise ValueError(f"unknown BatchNorm policy {bn!r}; choose one of {', '.join(BN_POLICIES)}")
    return bn


def is_shared(role: str, algorithm: str, *, batchnorm: bool = False, bn: str = "shared") -> bool:
    """Whether a tensor of `role` is aggregated; `batchnorm`: it belongs to a BatchNorm layer, which
    the "local" policy keeps on the device whatever its role."""
    return role == get_algorithm(algorithm).shared_role and not (batchnorm and check_bn(bn) == "local")


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
