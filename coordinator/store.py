"""The coordinator's state directory: atomic files, and state.json as the single commit point.

Every file is written to a temporary name, fsynced and renamed (os.replace), then the directory
is fsynced. Tensor files get a new name per version and state.json, written last, says which
ones are current, so a kill at any instant leaves either the old or the new checkpoint whole.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load

from fedper import files

STATE_FILE = "state.json"
METRICS_FILE = "metrics.jsonl"
FINAL_FILE = "final.safetensors"


class CheckpointError(RuntimeError):
    """The state directory could not be written (e.g. disk full): the previous checkpoint is intact."""


def atomic_write(path: Path, data: bytes) -> None:
    try:
        files.atomic_write(path, data)
    except OSError as e:
        raise CheckpointError(f"cannot write {path}: {e}") from e


class Store:
    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def load_state(self) -> dict[str, Any] | None:
        path = self.dir / STATE_FILE
        return json.loads(path.read_text()) if path.exists() else None

    def commit(self, state: dict[str, Any]) -> None:
        """Make `state` current, then delete tensor files it no longer names."""
        atomic_write(self.dir / STATE_FILE, json.dumps(state, indent=1).encode())
        keep = {v for v in _file_refs(state)}
        for path in self.dir.glob("*.safetensors"):
            if path.name not in keep and path.name != FINAL_FILE:
                path.unlink(missing_ok=True)

    def write_tensors(self, name: str, tensors: Mapping[str, np.ndarray]) -> str:
        atomic_write(self.dir / name, safetensors_parts(tensors))
        return name

    def write_bytes(self, name: str, data: bytes) -> str:
        atomic_write(self.dir / name, data)
        return name

    def read_tensors(self, name: str) -> dict[str, np.ndarray]:
        return st_load((self.dir / name).read_bytes())

    def read_bytes(self, name: str) -> bytes:
        return (self.dir / name).read_bytes()

    def append_metrics(self, record: dict[str, Any]) -> None:
        try:
            with open(self.dir / METRICS_FILE, "a") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise CheckpointError(f"cannot append to {self.dir / METRICS_FILE}: {e}") from e


# numpy dtype name -> safetensors dtype code (the format's spec)
_SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32",
                       "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def safetensors_parts(tensors: Mapping[str, np.ndarray]) -> list[bytes | memoryview]:
    """A safetensors file as its header and then each array's own memory: what a file write needs,
    without safetensors.numpy.save's in-memory copy of the whole file (2x a float64 partial sum).
    Layout per the format: u64 little-endian header length, JSON header (padded with spaces to a
    multiple of 8), the little-endian buffers back to back in header order."""
    arrays = {name: np.require(a, a.dtype.newbyteorder("<"), "C") for name, a in tensors.items()}
    header: dict[str, Any] = {}
    offset = 0
    for name, a in arrays.items():
        header[name] = {"dtype": _SAFETENSORS_DTYPES[a.dtype.name], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return [struct.pack("<Q", len(head)), head, *(a.reshape(-1).view(np.uint8).data for a in arrays.values())]


def _file_refs(state: dict[str, Any]) -> list[str]:
    """Every *.safetensors name that a state mentions, however deep."""
    if isinstance(state, dict):
        return [r for v in state.values() for r in _file_refs(v)]
    if isinstance(state, list):
        return [r for v in state for r in _file_refs(v)]
    return [state] if isinstance(state, str) and state.endswith(".safetensors") else []
