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
- `int8-delta-pc`: `int8-delta` with a grid per output channel: a tensor of two or more
  dimensions has C = shape[0] channels (the rows of its row-major layout), any other one channel.
  Channel c is quantized on [lo_c, hi_c] of its own change, scale_c = (hi_c - lo_c) / 255 rounded
  up to float32, so a channel that moved little is not rounded on the grid of one that moved a
  lot. `fedper.quant` is {tensor name: base64 (RFC 4648, padded) of C float32 little-endian
  (lo_c, scale_c) pairs}: 8 bytes a channel, whatever the values.
- `int8-delta-rot`: `int8-delta-pc` on a rotated channel and a curved grid, the same bytes. A
  channel of n = 2..65536 values, n a power of two, is first turned by a fixed orthogonal map:
  y = H(s * d) / n, H the n x n Sylvester-Hadamard matrix and s fixed signs (`_signs`); the
  decoder turns it back, d = s * H(y). A channel's change is heavy-tailed (a few values set its
  range); the rotated one is nearly Gaussian, a narrower range for the same spread. Its grid
  is `lo_c + scale_c * GRID[q]`, GRID 256 fixed levels from 0 to 255, a step of 0.75 in the
  middle and 1.5 at the ends, where a Gaussian has fewer values (docs/protocol.md has both
  definitions and a worked example).

Tensors that are not float32 pass through unchanged, and so do the float32 tensors the caller
names `exact`: the wire keeps BatchNorm running statistics exact, because quantizing a variance
that spans orders of magnitude (a near-zero one rounds to zero) wrecks the layer it normalizes.
`decode` always returns float32 for the tensors that were float32 (a float32 array under any codec
is one sent exact), and refuses arrays whose dtypes, codec or parameters do not agree.
Arrays in, arrays and metadata out: the module knows nothing about bytes, manifests or the wire;
`fedper.payload` writes the safetensors blob and validates names and shapes on both sides.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import math
from collections.abc import Collection, Mapping

import numpy as np

CODECS = ("fp32", "fp16", "int8", "int8-delta", "int8-delta-pc", "int8-delta-rot")
DELTA_CODECS = ("int8-delta", "int8-delta-pc", "int8-delta-rot")  # the difference from a reference both ends hold
QUANTIZED = ("int8", "int8-delta", "int8-delta-pc", "int8-delta-rot")
PER_CHANNEL = ("int8-delta-pc", "int8-delta-rot")  # a grid per output channel, its parameters as base64 float32
ROTATED = ("int8-delta-rot",)  # channels rotated (`_rotates`, `_hadamard`) and quantized on the curved `GRID`
CODEC_KEY = "fedper.codec"
QUANT_KEY = "fedper.quant"
FP16_MAX = float(np.finfo(np.float16).max)
_STORED = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), **{c: np.dtype(np.uint8) for c in QUANTIZED}}
_PAIR = np.dtype("<f4")  # a per-channel parameter on the wire: float32, little-endian
_ROTATED_MAX = 1 << 16  # the longest channel `int8-delta-rot` rotates (its Hadamard factors stay <= 256 x 256)
_HALF_STEPS = np.arange(256) - 127.5
GRID = 127.5 + 0.75 * _HALF_STEPS + _HALF_STEPS**3 / 65025  # int8-delta-rot's levels: GRID[0] = 0, GRID[255] = 255
_GRID_EDGES = np.append((GRID[1:] + GRID[:-1]) / 2, np.inf)  # a value goes to its nearest level
_BIN = 0.25  # a lookup bin, narrower than GRID's narrowest step (0.75): no bin holds two edges
_EDGES_BELOW = np.searchsorted(_GRID_EDGES, np.arange(1021) * _BIN)  # per bin: the edges below its start


class CodecError(ValueError):
    """An unknown codec, a tensor a codec cannot represent, or encoded arrays that do not match their metadata."""


def check_codec(codec: str) -> str:
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}: choose one of {', '.join(CODECS)}")
    return codec


def channels(shape: tuple[int, ...]) -> int:
    """How many grids a per-channel codec gives a tensor: one per output channel (axis 0) from two
    dimensions up; a vector or a scalar is one channel (a grid per value would cost more than float32)."""
    return int(shape[0]) if len(shape) >= 2 else 1


def _reference(reference: Mapping[str, np.ndarray] | None, codec: str, name: str, x: np.ndarray) -> np.ndarray:
    """The reference tensor a delta codec encodes `name` against, checked against `x`'s shape."""
    if reference is None:
        raise CodecError(f"codec {codec} encodes the difference from the round's model: it needs that model")
    if name not in reference or np.shape(reference[name]) != x.shape:
        raise CodecError(f"{name}: no reference tensor of shape {list(x.shape)} for codec {codec}")
    return np.asarray(reference[name], dtype=np.float32)


def _rows(x: np.ndarray, count: int) -> np.ndarray:
    """`x` as `count` rows, one per channel (reshape(count, -1) cannot infer a row of an empty array)."""
    return x.reshape(count, x.size // count if x.size else 0)


def _quantize(x: np.ndarray, per_channel: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(uint8 q, lo, scale), one (lo, scale) per channel: q = round((x - lo) / scale) on each channel's
    [lo, hi], within scale / 2 of x. Per-channel parameters are the float32 values sent (scale
    rounded up, so the channel's range still fits 255 steps); per-tensor ones stay float64 (JSON)."""
    rows = _rows(x, channels(x.shape) if per_channel else 1).astype(np.float64)
    if per_channel:
        lo, scale = _float32_grid(rows)  # lo: an element of x, so exact
    else:
        lo, hi = _range(rows)
        scale = (hi - lo) / 255.0
    q = np.rint(_steps(rows, lo, scale)).clip(0, 255)
    return q.astype(np.uint8).reshape(x.shape), lo, scale


def _range(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's (min, max); (0, 0) for rows of no values."""
    return (rows.min(1), rows.max(1)) if rows.shape[1] else (np.zeros(len(rows)), np.zeros(len(rows)))


def _float32_grid(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's (lo, scale) as the float32 values sent, in float64: lo rounded down from the row's
    minimum and scale up from 1/255 of the rest of its range, so that [lo, lo + 255 scale] still
    covers the row."""
    low, high = _range(rows)
    lo = low.astype(np.float32)
    lo = np.where(lo > low, np.nextafter(lo, np.float32(-np.inf)), lo).astype(np.float64)
    wide = (high - lo) / 255.0
    scale = wide.astype(np.float32)
    return lo, np.where(scale < wide, np.nextafter(scale, np.float32(np.inf)), scale).astype(np.float64)


def _steps(rows: np.ndarray, lo: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """(rows - lo) / scale per row, in steps of its grid; a constant row (scale 0) is all 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(scale[:, None] > 0, (rows - lo[:, None]) / scale[:, None], 0.0)


def _rotates(n: int) -> bool:
    return 2 <= n <= _ROTATED_MAX and n & (n - 1) == 0


@functools.cache
def _signs(n: int) -> np.ndarray:
    """s_i = -1 where bit i of SHAKE128(b"fedper int8-delta-rot") is set (bits least significant first
    in each byte), else +1: fixed, random-looking signs that keep a structured channel (a constant
    one, say) from landing on a single Hadamard row."""
    stream = np.frombuffer(hashlib.shake_128(b"fedper int8-delta-rot").digest((n + 7) // 8), np.uint8)
    return 1.0 - 2.0 * np.unpackbits(stream, count=n, bitorder="little").astype(np.float64)


@functools.cache
def _sylvester(n: int) -> np.ndarray:
    """The n x n Hadamard matrix of Sylvester's construction, H_2n = [[H_n, H_n], [H_n, -H_n]] from H_1 = [1]."""
    matrix = np.ones((1, 1))
    while len(matrix) < n:
        matrix = np.block([[matrix, matrix], [matrix, -matrix]])
    return matrix


def _hadamard(rows: np.ndarray) -> np.ndarray:
    """rows @ H (n a power of two) as H_a (x) H_b, a * b = n: two matrix products of sqrt(n)-wide
    factors instead of one n x n (float64; H is symmetric and H @ H = n I)."""
    count, n = rows.shape
    a = 1 << (n.bit_length() - 1) // 2
    b = n // a
    blocks = (rows.reshape(count * a, b) @ _sylvester(b)).reshape(count, a, b)
    return np.matmul(_sylvester(a), blocks).reshape(count, n)


def _quantize_rotated(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(uint8 q, lo, scale) of `int8-delta-rot`: each channel rotated when its length allows, then
    its nearest GRID level on [lo, lo + 255 scale] (lo rounded down and scale up to float32, so the
    float32 parameters sent still cover the channel)."""
    rows = _rows(x, channels(x.shape)).astype(np.float64)
    n = rows.shape[1]
    if _rotates(n):
        rows = _hadamard(rows * _signs(n)) / n
    lo, scale = _float32_grid(rows)
    return _nearest_level(_steps(rows, lo, scale)).astype(np.uint8).reshape(x.shape), lo, scale


def _nearest_level(steps: np.ndarray) -> np.ndarray:
    """The index of the GRID level nearest each of `steps` (in [0, 255]): the edges below its lookup
    bin, plus one if the bin's own edge is below it too (np.searchsorted's answer, a few times faster)."""
    below = _EDGES_BELOW[np.clip(steps / _BIN, 0, len(_EDGES_BELOW) - 1).astype(np.intp)]
    return below + (_GRID_EDGES[below] < steps)


def _dequantize(x: np.ndarray, codec: str, lo: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The float64 change (or, for `int8`, value) a quantized uint8 tensor stands for."""
    if codec not in ROTATED:
        return (lo[:, None] + _rows(x, len(lo)).astype(np.float64) * scale[:, None]).reshape(x.shape)
    rows = lo[:, None] + GRID[_rows(x, len(lo))] * scale[:, None]
    n = rows.shape[1]
    return (_hadamard(rows) * _signs(n) if _rotates(n) else rows).reshape(x.shape)


def encode(
    tensors: Mapping[str, np.ndarray], codec: str, exact: Collection[str] = (),
    reference: Mapping[str, np.ndarray] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(arrays, safetensors metadata) for `codec`, the `exact` tensors left float32; float32
    tensors must be finite. Delta codecs encode x - reference[name]."""
    check_codec(codec)
    arrays: dict[str, np.ndarray] = {}
    quant: dict[str, list[float] | str] = {}
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
            if codec in ROTATED:
                arrays[name], lo, scale = _quantize_rotated(x)
            else:
                arrays[name], lo, scale = _quantize(x, per_channel=codec in PER_CHANNEL)
            if codec in PER_CHANNEL:
                quant[name] = base64.b64encode(np.stack([lo, scale], axis=1).astype(_PAIR).tobytes()).decode()
            else:
                quant[name] = [float(lo[0]), float(scale[0])]
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
    quant = _quant_params(metadata, codec, arrays) if codec in QUANTIZED else {}
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
            base = _reference(reference, codec, name, x).astype(np.float64) if codec in DELTA_CODECS else 0.0
            with np.errstate(over="ignore", invalid="ignore"):  # a hostile [lo, scale] overflows: refused below
                out[name] = (base + _dequantize(x, codec, *quant[name])).astype(np.float32)
        else:
            out[name] = x.astype(np.float32)
        if not np.isfinite(out[name]).all():
            raise CodecError(f"{name} decodes to NaN or Inf")
    return out


def _passes_through(x: np.ndarray) -> bool:
    """Integer tensors (counters, indices) travel unchanged; uint8 is reserved for quantized data."""
    return x.dtype.kind in "iu" and x.dtype != np.uint8


def _quant_params(metadata: Mapping[str, str], codec: str,
                  arrays: Mapping[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{name: (lo, scale)}, one entry per channel, each checked: finite, scale >= 0 (0: a constant
    channel), as many channels as the array's shape has; a per-channel string is measured before it
    is decoded, so the metadata cannot make the decoder allocate more than the arrays already hold."""
    try:
        raw = json.loads(metadata[QUANT_KEY])
    except (KeyError, TypeError, ValueError):
        raise CodecError(f"int8 arrays without valid {QUANT_KEY} metadata") from None
    if not isinstance(raw, dict):
        raise CodecError(f"{QUANT_KEY} must be a JSON object")
    unused = sorted(set(raw) - set(arrays))
    if unused:
        raise CodecError(f"quantization parameters for tensors not in the arrays: {unused[:3]}")
    params = {}
    for name, value in raw.items():
        if codec in PER_CHANNEL:
            lo, scale = _channel_params(name, value, channels(np.shape(arrays[name])))
        else:
            ok = isinstance(value, list) and len(value) == 2 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
            if not ok:
                raise CodecError(f"{QUANT_KEY}[{name!r}] must be [lo, scale] with finite numbers and scale >= 0")
            lo, scale = np.array([float(value[0])]), np.array([float(value[1])])
        if not (np.isfinite(lo).all() and np.isfinite(scale).all() and (scale >= 0).all()):
            raise CodecError(f"{QUANT_KEY}[{name!r}]: every lo and scale must be finite, and scale >= 0")
        params[name] = (lo, scale)
    return params


def _channel_params(name: str, value: object, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The `count` (lo, scale) float32 pairs of a per-channel tensor from their base64 string."""
    size = 4 * math.ceil(count * 2 * _PAIR.itemsize / 3)  # padded base64 of 8 bytes a channel
    if not isinstance(value, str) or len(value) != size:
        raise CodecError(f"{QUANT_KEY}[{name!r}] must be base64 of {count} (lo, scale) float32 pairs "
                         f"({size} characters), one per channel")
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError:
        raise CodecError(f"{QUANT_KEY}[{name!r}] is not valid base64") from None
    if len(raw) != count * 2 * _PAIR.itemsize:
        raise CodecError(f"{QUANT_KEY}[{name!r}] decodes to {len(raw)} bytes, not {count} (lo, scale) float32 pairs")
    pairs = np.frombuffer(raw, _PAIR).reshape(count, 2).astype(np.float64)
    return pairs[:, 0], pairs[:, 1]
