"""Opt-in update compression: a codec turns float32 tensors into smaller ones and back.

Codecs (the name a device announces, the `fedper.codec` entry of the blob's safetensors metadata):

- `fp32`: identity; the blob is exactly what `safetensors` writes for the float32 tensors.
- `fp16`: every float32 tensor cast to float16 (half the bytes). A tensor with values beyond
  float16's +-65504 (a BatchNorm running_var can grow that large) stays float32 in the blob.
- `int8`: 8-bit per-tensor affine quantization: q = round((x - lo) / scale), stored as uint8, with
  scale = (hi - lo) / 255 over the tensor's range [lo, hi] (a quarter of the bytes). Decoding
  gives lo + q * scale, within scale / 2 of x. The parameters travel in the safetensors metadata,
  not as extra tensors, so the blob's tensor names stay the manifest's: `fedper.quant` is a JSON
  object {tensor name: [lo, scale]} (numbers as JSON doubles, exact for float32 values).
- `int8-delta`: `int8` applied to d = x - r, where r is the `reference` both ends hold (on the
  wire: the model of the round the update answers); decoding gives r + lo + q * scale. The grid
  then spans the round's change instead of the weights' whole range: `int8` of whole weights
  costs 8-14 % of a late round's step, since a round moves the weights by less than its grid
  (docs/performance.md).

Tensors that are not float32 pass through unchanged, and so do the float32 tensors the caller
names `exact`: the wire keeps BatchNorm running statistics exact, because quantizing a variance
that spans orders of magnitude (a near-zero one rounds to zero) wrecks the layer it normalizes.
`decode` always returns float32 for the tensors that were float32 (a float32 tensor in any blob is
one sent exact), and refuses a blob whose dtypes, codec or parameters do not agree.
The module knows nothing about manifests or the wire: callers validate names and shapes
(`fedper.tensors`) before encoding and after decoding.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Collection, Mapping

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

CODECS = ("fp32", "fp16", "int8", "int8-delta")
DELTA_CODECS = ("int8-delta",)  # they encode the difference from a reference both ends hold
QUANTIZED = ("int8", "int8-delta")
CODEC_KEY = "fedper.codec"
QUANT_KEY = "fedper.quant"
FP16_MAX = float(np.finfo(np.float16).max)
_STORED = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "int8": np.dtype(np.uint8),
           "int8-delta": np.dtype(np.uint8)}


class CodecError(ValueError):
    """An unknown codec, a tensor a codec cannot represent, or a malformed encoded blob."""


def check_codec(codec: str) -> str:
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}: choose one of {', '.join(CODECS)}")
    return codec


def _reference(reference: Mapping[str, np.ndarray] | None, codec: str, name: str, x: np.ndarray) -> np.ndarray:
    """The reference tensor a delta codec encodes `name` against, checked against `x`'s shape."""
    if reference is None:
        raise CodecError(f"codec {codec} encodes the difference from the round's model: it needs that model")
    if name not in reference or np.shape(reference[name]) != x.shape:
        raise CodecError(f"{name}: no reference tensor of shape {list(x.shape)} for codec {codec}")
    return np.asarray(reference[name], dtype=np.float32)


def encode(
    tensors: Mapping[str, np.ndarray], codec: str, exact: Collection[str] = (),
    reference: Mapping[str, np.ndarray] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(arrays, safetensors metadata) for `codec`, the `exact` tensors left float32; float32
    tensors must be finite. Delta codecs encode x - reference[name]."""
    check_codec(codec)
    arrays: dict[str, np.ndarray] = {}
    quant: dict[str, list[float]] = {}
    for name, value in tensors.items():
        x = np.asarray(value)
        if _passes_through(x):
            arrays[name] = x
            continue
        if x.dtype != np.float32:
            raise CodecError(f"{name} is {x.dtype}: a codec takes float32 tensors (integer ones but uint8 pass as-is)")
        if not np.isfinite(x).all():
            raise CodecError(f"{name} holds NaN or Inf")
        if codec == "fp32" or name in exact:
            arrays[name] = x
        elif codec == "fp16":
            fits = not x.size or float(np.abs(x).max()) <= FP16_MAX
            arrays[name] = x.astype(np.float16) if fits else x
        else:
            if codec in DELTA_CODECS:
                x = x - _reference(reference, codec, name, x)
                if not np.isfinite(x).all():
                    raise CodecError(f"{name}: its difference from the reference overflows float32")
            lo, hi = (float(x.min()), float(x.max())) if x.size else (0.0, 0.0)
            scale = (hi - lo) / 255.0
            q = np.zeros(x.shape, np.uint8) if scale == 0 else np.rint((x - lo) / scale).clip(0, 255)
            arrays[name] = q.astype(np.uint8)
            quant[name] = [lo, scale]
    metadata = {CODEC_KEY: codec}
    if codec in QUANTIZED:
        metadata[QUANT_KEY] = json.dumps(quant, separators=(",", ":"))
    return arrays, metadata


def decode(arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str],
           reference: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The float32 tensors back; CodecError when the arrays do not match the metadata's codec, or a
    delta codec's `reference` is missing or has another shape."""
    codec = check_codec(metadata.get(CODEC_KEY, ""))
    stored = _STORED[codec]
    quant = _quant_params(metadata) if codec in QUANTIZED else {}
    out: dict[str, np.ndarray] = {}
    for name, value in arrays.items():
        x = np.asarray(value)
        if _passes_through(x) and name not in quant:
            out[name] = x
            continue
        if x.dtype == np.float32 and name not in quant:
            out[name] = x  # sent exact
        elif x.dtype != stored or (codec in QUANTIZED) != (name in quant):
            raise CodecError(f"{name} is {x.dtype}: not what codec {codec} writes, or its parameters are missing")
        elif codec in QUANTIZED:
            lo, scale = quant[name]
            base = _reference(reference, codec, name, x).astype(np.float64) if codec in DELTA_CODECS else 0.0
            with np.errstate(over="ignore"):  # a hostile [lo, scale] overflows: refused just below
                out[name] = (base + (lo + x.astype(np.float64) * scale)).astype(np.float32)
        else:
            out[name] = x.astype(np.float32)
        if not np.isfinite(out[name]).all():
            raise CodecError(f"{name} decodes to NaN or Inf")
    unused = sorted(set(quant) - set(arrays))
    if unused:
        raise CodecError(f"quantization parameters for tensors not in the blob: {unused[:3]}")
    return out


def _passes_through(x: np.ndarray) -> bool:
    """Integer tensors (counters, indices) travel unchanged; uint8 is reserved for quantized data."""
    return x.dtype.kind in "iu" and x.dtype != np.uint8


def _quant_params(metadata: Mapping[str, str]) -> dict[str, tuple[float, float]]:
    try:
        raw = json.loads(metadata[QUANT_KEY])
    except (KeyError, TypeError, ValueError):
        raise CodecError(f"int8 blob without valid {QUANT_KEY} metadata") from None
    if not isinstance(raw, dict):
        raise CodecError(f"{QUANT_KEY} must be a JSON object")
    params = {}
    for name, pair in raw.items():
        ok = isinstance(pair, list) and len(pair) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in pair)
        if not ok or pair[1] < 0:
            raise CodecError(f"{QUANT_KEY}[{name!r}] must be [lo, scale] with finite numbers and scale >= 0")
        params[name] = (float(pair[0]), float(pair[1]))
    return params


def pack(tensors: Mapping[str, np.ndarray], codec: str, exact: Collection[str] = (),
         reference: Mapping[str, np.ndarray] | None = None) -> bytes:
    """One safetensors blob: the encoded arrays with the codec and its parameters in the metadata."""
    arrays, metadata = encode(tensors, codec, exact, reference)
    return st_save({name: np.ascontiguousarray(a) for name, a in arrays.items()}, metadata=metadata)


def unpack(blob: bytes, reference: Mapping[str, np.ndarray] | None = None) -> tuple[str, dict[str, np.ndarray]]:
    """(codec, float32 tensors) of a blob written by `pack` (with the same `reference` for a delta codec)."""
    blob = bytes(blob)
    try:
        arrays = st_load(blob)
    except (SafetensorError, ValueError, OSError) as e:
        raise CodecError(f"not a valid safetensors blob: {e}") from None
    metadata = _metadata(blob)
    return check_codec(metadata.get(CODEC_KEY, "")), decode(arrays, metadata, reference)


def codec_of(blob: bytes) -> str:
    """The codec a blob names; a blob that names none is plain fp32 (what `fedper.tensors` writes)."""
    try:
        return check_codec(_metadata(bytes(blob)).get(CODEC_KEY, "fp32"))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise CodecError(f"not a valid safetensors header: {e}") from None


def _metadata(blob: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors header (already length-checked by st_load)."""
    (n,) = struct.unpack_from("<Q", blob)
    metadata = json.loads(blob[8 : 8 + n]).get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise CodecError("safetensors __metadata__ must be an object")
    return metadata
