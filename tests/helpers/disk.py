"""Filling a disk for real (the `small_fs` fixture in tests/conftest.py mounts one small enough)."""

from __future__ import annotations

from pathlib import Path


def fill(directory: Path) -> Path:
    """Write a file until the file system says ENOSPC; its path (delete it to free the space)."""
    path = directory / "filler"
    with open(path, "wb", buffering=0) as f:
        try:
            while f.write(b"\xff" * 4096):
                pass
        except OSError:
            pass
    return path
