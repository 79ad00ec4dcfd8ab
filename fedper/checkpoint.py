"""Durable state, one way for the coordinator, the agent and the emulator: a crash or a full disk
leaves the previous version of a file whole, never a mix.

Every file goes through `atomic_write`: a temporary name, fsync, os.replace over the old one, fsync
of the folder; or, for large blobs that an atomic file then names with their digest, `overwrite` in
place. Two formats, nothing else (no pickle):

    checkpoint  a safetensors file: the tensors, and the rest as one JSON document in the header's
                metadata (key "json"); `write_checkpoint` streams the header and then each array's
                own memory, so a large float64 sum is never copied whole to be written
    JSON file   state that holds no tensors (`write_json`)

State is private to its owner: a role's state directory is created (or tightened, `private_dir`) mode 700 and
its files written mode 600 (`mode=PRIVATE`): the coordinator's DP noise secret and a device's head sit there.

Errors are left as they come (OSError when writing; CorruptCheckpoint when a file is not a
checkpoint) for each role to explain in its own terms.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

Buffer = bytes | bytearray | memoryview
META_KEY = "json"  # the safetensors metadata key that holds a checkpoint's JSON document

# numpy dtype name -> safetensors dtype code (the format's spec)
_SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32",
                       "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


PRIVATE = 0o600  # a state file: its owner reads and writes it, nobody else
PRIVATE_DIR = 0o700


class CorruptCheckpoint(ValueError):
    """A file that is not a readable checkpoint (truncated, overwritten, or another format)."""


def tightened_line(path: Path, tightened: list[str]) -> str:
    """The one line a role logs when `private_dir` tightened an existing state directory."""
    more = f" and {len(tightened) - 4} more" if len(tightened) > 4 else ""
    return (f"state directory {path} was open to other users; group and others' access removed: "
            f"{', '.join(tightened[:4])}{more}")


def private_dir(path: Path) -> list[str]:
    """Create `path` (mode 700) or take group's and others' access away from it and the files in it: what was
    tightened, as "name (was 0644)", for the caller to say in one line (empty: nothing was). An entry this user
    does not own cannot be changed: it is named "(0755, not this user's: left as is)"."""
    path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    tightened: list[str] = []
    for entry in [path, *path.iterdir()]:
        mode = stat.S_IMODE(entry.lstat().st_mode)
        if mode & 0o077 and not entry.is_symlink():
            name = entry.name if entry != path else "."
            try:
                entry.chmod(mode & ~0o077)
                tightened.append(f"{name} (was {mode:04o})")
            except PermissionError:
                tightened.append(f"{name} ({mode:04o}, not this user's: left as is)")
    return tightened


def opener(mode: int) -> Any:
    """An `open` opener that creates the file with `mode` (less the umask)."""
    return lambda name, flags: os.open(name, flags, mode)


def atomic_write(path: Path, data: Buffer | Iterable[Buffer], mode: int = 0o666) -> None:
    """Readers see the old content or the new, never a mix: temp file, fsync, rename, fsync the folder.

    `data` may be a sequence of buffers written one after another (no joined copy in memory); the file is
    created with `mode` less the umask (PRIVATE: state).

    On any OSError (e.g. ENOSPC) the temp file is removed, `path` keeps its old content, and the
    error propagates."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.unlink(missing_ok=True)  # one left by a kill keeps its mode: a new file takes `mode`
        with open(tmp, "wb", opener=opener(mode)) as f:
            for part in [data] if isinstance(data, Buffer) else data:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def overwrite(path: Path, data: Buffer, mode: int = 0o666) -> None:
    """Write `data` at the start of `path` in place (created if missing) and fdatasync it: a file reused for
    data of about the same size keeps its disk blocks, so this costs a memory copy and one flush, where a new
    file costs an allocation per block. Not atomic: a crash mid-write leaves a mix, so a caller names the file
    and the size written (`read_prefix`) in an atomic file only after this returns, and never overwrites a
    file that its current atomic file names. Bytes past `data` from an earlier, longer write stay. A new file
    takes `mode` less the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, mode)
    try:
        view = memoryview(data).cast("B")
        written = 0
        while written < len(view):
            written += os.pwrite(fd, view[written:], written)
        os.fdatasync(fd)
    finally:
        os.close(fd)


def read_prefix(path: Path, size: int) -> bytes:
    """The first `size` bytes of `path` (what `overwrite` wrote there); OSError if it is shorter."""
    with open(path, "rb") as f:
        data = f.read(size)
    if len(data) != size:
        raise OSError(f"{path} holds {len(data)} bytes, fewer than the {size} written there")
    return data


def write_json(path: Path, body: Any, *, indent: int | None = None, mode: int = 0o666) -> None:
    atomic_write(path, json.dumps(body, indent=indent).encode(), mode)


def read_json(path: Path) -> Any:
    """The document in `path`; OSError if it cannot be read, ValueError if it is not JSON."""
    return json.loads(path.read_bytes())


def write_checkpoint(path: Path, tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any] | None = None,
                     mode: int = 0o666) -> None:
    """`tensors` and `meta` (a JSON-serializable mapping; None writes no metadata) as one safetensors file."""
    atomic_write(path, safetensors_parts(tensors, None if meta is None else {META_KEY: json.dumps(meta)}), mode)


def read_checkpoint(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(tensors, meta) of a file `write_checkpoint` wrote; meta is {} for a file written without it.

    The file is memory-mapped, so each tensor is read once into its own array. OSError if it cannot
    be opened; CorruptCheckpoint if it is not a safetensors file or its metadata is not JSON."""
    try:
        with safe_open(str(path), framework="np") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
        meta = json.loads(metadata[META_KEY]) if META_KEY in metadata else {}
    except (SafetensorError, ValueError) as e:
        raise CorruptCheckpoint(f"{path} is not a readable checkpoint: {e}") from None
    if not isinstance(meta, dict):
        raise CorruptCheckpoint(f"{path}: its metadata is not a JSON object")
    return tensors, meta


def safetensors_parts(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> list[Buffer]:
    """A safetensors file as its header and then each array's own memory: what a file write needs,
    without safetensors.numpy.save's in-memory copy of the whole file (2x a float64 partial sum).
    Layout per the format: u64 little-endian header length, JSON header (string `metadata` under
    "__metadata__", padded with spaces to a multiple of 8), the little-endian buffers back to back
    in header order."""
    arrays = {name: np.require(a, a.dtype.newbyteorder("<"), "C") for name, a in tensors.items()}
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, a in arrays.items():
        header[name] = {"dtype": _SAFETENSORS_DTYPES[a.dtype.name], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return [struct.pack("<Q", len(head)), head, *(a.reshape(-1).view(np.uint8).data for a in arrays.values())]
