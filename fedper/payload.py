"""A blob of shared tensors: the only way parameters leave a process, and the only way they come in.

The format is safetensors (a JSON header + raw little-endian buffers; nothing executes on load).
`encode_shared` takes the manifest and serializes exactly its shared tensors: a device-local tensor
(the head, for FedPer) is refused before anything is written, so it cannot be sent. Under a
compressing codec (`fedper.compression`) the encoded arrays keep the manifest's names, and the
codec and its parameters travel in the safetensors `__metadata__`; an fp32 blob is plain
safetensors with no metadata. BatchNorm running statistics (the shared tensors that are not
trainable) always travel exact. `decode_shared` undoes the codec and checks that the result is
exactly the manifest's shared layout (names, shapes, dtypes, finite values) before anybody uses it.
An fp32 blob decodes without a copy: its tensors are read-only views into the blob, and, since a
safetensors data section holds them back to back, they come as a fedper.aggregation.PackedTensors,
whose `flat` array the fold streams through in a few large blocks.

Every refusal, on either side, is a `PayloadError`: the protocol's `bad_tensors`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from fedper import compression
from fedper.aggregation import PackedTensors
from fedper.manifest import Manifest
from fedper.wire import WireError


class PayloadError(WireError):
    """A blob or a mapping of tensors that is not the manifest's shared layout, or a codec refusal."""

    def __init__(self, message: str) -> None:
        super().__init__("bad_tensors", message)


def encode_shared(manifest: Manifest, tensors: Mapping[str, np.ndarray], codec: str = "fp32",
                  base: Mapping[str, np.ndarray] | None = None) -> bytes:
    """safetensors bytes of exactly the shared tensors, in manifest order, through `codec`; `base` is
    the round's model, which a delta codec encodes against."""
    _check_names(manifest, tensors, what="encode")
    _check_values(manifest, tensors, what="encode")
    shared = manifest.shared_tensors
    if codec == "fp32":
        return st_save({t.name: np.ascontiguousarray(tensors[t.name]) for t in shared})
    try:
        arrays, metadata = compression.encode({t.name: tensors[t.name] for t in shared}, codec,
                                              exact={t.name for t in shared if not t.trainable}, reference=base)
    except compression.CodecError as e:
        raise PayloadError(str(e)) from None
    return st_save({name: np.ascontiguousarray(a) for name, a in arrays.items()}, metadata=metadata)


def decode_shared(manifest: Manifest, blob: bytes, codec: str | None = None,
                  base: Mapping[str, np.ndarray] | None = None) -> Mapping[str, np.ndarray]:
    """The blob's shared tensors in manifest order, decompressed as its metadata says and validated.
    `codec`, when given, is what the sender announced: the blob must say the same. `base`: the
    round's model, for a blob whose codec encodes the difference from it. An fp32 blob whose tensors
    are all float32 comes back as a PackedTensors of read-only views into the blob."""
    blob = bytes(blob)
    try:
        arrays = st_load(blob)  # the reference implementation's checks of the header and the offsets
    except (SafetensorError, ValueError, OSError) as e:
        raise PayloadError(f"not a valid safetensors blob: {e}") from None
    metadata = safetensors_metadata(blob)
    sent = metadata.get(compression.CODEC_KEY, "fp32")
    if codec is not None and codec != sent:
        raise PayloadError(f"the update announces codec {codec!r}, its blob is {sent!r}")
    _check_names(manifest, arrays, what="decode")
    if sent != "fp32":  # an fp32 blob holds the tensors as they are: _check_values is all it needs
        try:
            arrays = compression.decode(arrays, metadata, base)
        except compression.CodecError as e:
            raise PayloadError(str(e)) from None
    ordered = {t.name: arrays[t.name] for t in manifest.shared_tensors}
    if sent == "fp32":
        ordered = _float32_views(blob, ordered) or ordered
    _check_values(manifest, ordered, what="decode")  # what is handed on, views or copies
    return ordered


def _float32_views(blob: bytes, copies: Mapping[str, np.ndarray]) -> PackedTensors | None:
    """The blob's tensors (those of st_load's `copies`) as read-only views into it, when every one is
    float32 and the data section holds them back to back in sorted-name order (as safetensors writes
    them); None otherwise. The header is read again with every key unique and every offset an integer
    so that this reading cannot differ from st_load's; PackedTensors checks that the views tile the data."""
    (n,) = struct.unpack_from("<Q", blob)
    header = json.loads(blob[8 : 8 + n], object_pairs_hook=_unique_keys)
    if header is None:
        return None
    header.pop("__metadata__", None)
    if not copies or header.keys() != copies.keys() or (len(blob) - 8 - n) % 4:
        return None
    data = np.frombuffer(blob, np.float32, offset=8 + n)
    views = {}
    for name, copy in copies.items():
        entry = header[name]
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or any(type(o) is not int for o in offsets)
                or entry.get("dtype") != "F32" or copy.dtype != np.float32):
            return None
        begin, end = offsets
        if begin % 4 or end - begin != copy.nbytes:
            return None
        views[name] = data[begin // 4 : end // 4].reshape(copy.shape)
    try:
        return PackedTensors(views, data)
    except ValueError:
        return None


def _unique_keys(pairs: list[tuple[str, object]]) -> dict | None:
    """json's object_pairs_hook: the object, or None for one that names a key twice."""
    keys = [key for key, _ in pairs]
    return dict(pairs) if len(set(keys)) == len(keys) else None


def max_blob_size(manifest: Manifest) -> int:
    """An upper bound for an fp32 blob (the largest codec): data bytes plus generous room for the header."""
    data = sum(int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize for t in manifest.shared_tensors)
    return data + 256 * len(manifest.shared_tensors) + 4096


def _check_names(manifest: Manifest, tensors: Mapping[str, np.ndarray], *, what: str) -> None:
    """Exactly the shared tensors by name; a device-local one is named as such."""
    shared = manifest.names(shared=True)
    unknown = sorted(set(tensors) - set(shared))
    if unknown:
        local = [n for n in unknown if n in set(manifest.names(shared=False))]
        if local:
            raise PayloadError(f"{what}: refusing device-local tensors {local[:3]} (they never leave a device)")
        raise PayloadError(f"{what}: tensors not in the manifest: {unknown[:3]}")
    missing = [n for n in shared if n not in tensors]
    if missing:
        raise PayloadError(f"{what}: missing {len(missing)} shared tensors, e.g. {missing[:3]}")


def _check_values(manifest: Manifest, tensors: Mapping[str, np.ndarray], *, what: str) -> None:
    """Each shared tensor (names already checked) has the manifest's shape and dtype, and finite values."""
    for spec in manifest.shared_tensors:
        arr = tensors[spec.name]
        if tuple(arr.shape) != spec.shape or str(arr.dtype) != spec.dtype:
            raise PayloadError(f"{what}: {spec.name} is {arr.dtype}{list(arr.shape)}, "
                               f"the manifest says {spec.dtype}{list(spec.shape)}")
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise PayloadError(f"{what}: {spec.name} holds NaN or Inf")


def safetensors_metadata(blob: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors header that st_load accepted (so a map of strings, if any)."""
    (n,) = struct.unpack_from("<Q", blob)
    return json.loads(blob[8 : 8 + n]).get("__metadata__") or {}
