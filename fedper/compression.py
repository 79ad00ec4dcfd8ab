"""Opt-in update compression: a codec turns float32 tensors into smaller ones and back.

Codecs (the name a device announces, the `fedper.codec` entry of the metadata `encode` returns):

- `fp32`: identity (on the wire: plain safetensors of the float32 tensors, no metadata).
- `fp16`: every float32 tensor cast to float16 (half the bytes). A tensor with values beyond
  float16's +-65504 (a BatchNorm running_var can grow that large) stays float32.
- `int8`: 8-bit per-tensor affine quantization: q = round((x - lo) / scale), stored as uint8, with
  scale = (hi - lo) / 255 over the tensor's range [lo, hi] (a quarter of the bytes). Decoding
  gives lo + q * scale, within scale / 2 of x. The parameters travel in the metadata, not as
  extra tensors, so the tensor names stay the caller's: `fedper.quant` is a JSON
  object {tensor name: [lo, scale]} (numbers as JSON doubles, exact for float32 values).
- `int8-delta`: `int8` applied to d = x - r, where r is the `reference` both ends hold (on the
  wire: the model of the round the update answers); decoding gives r + lo + q * scale. The grid
  then spans the round's change instead of the weights' whole range: a late round moves the
  weights by less than whole-weight `int8`'s grid (docs/performance.md has the update errors).

Tensors that are not float32 pass through unchanged, and so do the float32 tensors the caller
names `exact`: the wire keeps BatchNorm running statistics exact, because quantizing a variance
that spans orders of magnitude (a near-zero one rounds to zero) wrecks the layer it normalizes.
`decode` always returns float32 for the tensors that were float32 (a float32 array under any codec
is one sent exact), and refuses arrays whose dtypes, codec or parameters do not agree.
Arrays in, arrays and metadata out: the module knows nothing about bytes, manifests or the wire;
`fedper.payload` writes the safetensors blob and validates names and shapes on both sides.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping

import numpy as np

CODECS = ("fp32", "fp16", "int8", "int8-delta")
DELTA_CODECS = ("int8-delta",)  # they encode the difference from a reference both ends hold
QUANTIZED = ("int8", "int8-delta")
CODEC_KEY = "fedper.codec"
QUANT_KEY = "fedper.quant"
FP16_MAX = float(np.finfo(np.float16).max)
_STORED = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "int8": np.dtype(np.uint8),
           "int8-delta": np.dtype(np.uint8)}


class CodecError(ValueError):
    """An unknown codec, a tensor a codec cannot represent, or encoded arrays that do not match their metadata."""


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
        raise CodecError(f"quantization parameters for tensors not in the arrays: {unused[:3]}")
    return out


def _passes_through(x: np.ndarray) -> bool:
    """Integer tensors (counters, indices) travel unchanged; uint8 is reserved for quantized data."""
    return x.dtype.kind in "iu" and x.dtype != np.uint8


def _quant_params(metadata: Mapping[str, str]) -> dict[str, tuple[float, float]]:
    try:
        raw = json.loads(metadata[QUANT_KEY])
    except (KeyError, TypeError, ValueError):
        raise CodecError(f"int8 arrays without valid {QUANT_KEY} metadata") from None
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

