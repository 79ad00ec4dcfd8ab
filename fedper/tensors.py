"""Shared tensors as bytes: the only way parameters leave a process.

The format is safetensors (a JSON header + raw little-endian buffers; nothing executes on load).
`pack_shared` takes the manifest and serializes exactly its shared tensors: a head tensor
(for FedPer) cannot be passed in, so it cannot be sent. `unpack_shared` checks that a blob holds
exactly the manifest's shared layout, with finite values, before anybody uses it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from fedper.manifest import Manifest


class TensorError(ValueError):
    """A blob or a mapping whose tensors do not match the manifest's shared layout."""


def check_shared(manifest: Manifest, tensors: Mapping[str, np.ndarray], *, what: str) -> None:
    expected = {t.name: t for t in manifest.shared_tensors}
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        local = [n for n in unknown if n in set(manifest.names(shared=False))]
        if local:
            raise TensorError(f"{what}: refusing device-local tensors {local[:3]} (they never leave a device)")
        raise TensorError(f"{what}: tensors not in the manifest: {unknown[:3]}")
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise TensorError(f"{what}: missing {len(missing)} shared tensors, e.g. {missing[:3]}")
    for name, spec in expected.items():
        arr = tensors[name]
        if tuple(arr.shape) != spec.shape or str(arr.dtype) != spec.dtype:
            raise TensorError(
                f"{what}: {name} is {arr.dtype}{list(arr.shape)}, the manifest says {spec.dtype}{list(spec.shape)}"
            )
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise TensorError(f"{what}: {name} holds NaN or Inf")


def pack_shared(manifest: Manifest, tensors: Mapping[str, np.ndarray]) -> bytes:
    """safetensors bytes of exactly the shared tensors, in manifest order."""
    check_shared(manifest, tensors, what="pack")
    return st_save({t.name: np.ascontiguousarray(tensors[t.name]) for t in manifest.shared_tensors})


def unpack_shared(manifest: Manifest, blob: bytes) -> dict[str, np.ndarray]:
    """Decode and validate; never trust a blob's header for anything but offsets."""
    try:
        tensors = st_load(bytes(blob))
    except (SafetensorError, ValueError, OSError) as e:
        raise TensorError(f"not a valid safetensors blob: {e}") from None
    check_shared(manifest, tensors, what="unpack")
    return {t.name: tensors[t.name] for t in manifest.shared_tensors}
