"""Writes that a crash or a full disk cannot leave half done: the coordinator's and the agent's state."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

Buffer = bytes | bytearray | memoryview


def atomic_write(path: Path, data: Buffer | Iterable[Buffer]) -> None:
    """Readers see the old content or the new, never a mix: temp file, fsync, rename, fsync the folder.

    `data` may be a sequence of buffers written one after another (no joined copy in memory).

    On any OSError (e.g. ENOSPC) the temp file is removed, `path` keeps its old content, and the
    error propagates for the caller to explain in its own terms."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
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
