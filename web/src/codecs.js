// The update codecs of fedper/compression.py (docs/protocol.md section 7.1), encoding side: what a device sends.
// The same arithmetic in the same float widths (float32 differences, float64 grids, float32 parameters rounded
// outward, round-half-to-even), so the page's encodings are the Python agent's: tests/vectors/web/codecs.json
// holds Python's, web/test/codecs.test.mjs compares, tests/test_web.py decodes the page's with Python's decoder.

import { shake128 } from './hash.js';

export const CODECS = ['fp32', 'fp16', 'int8', 'int8-delta', 'int8-delta-pc', 'int8-delta-rot'];
export const DELTA_CODECS = ['int8-delta', 'int8-delta-pc', 'int8-delta-rot'];
const PER_CHANNEL = ['int8-delta-pc', 'int8-delta-rot'];
const FP16_MAX = 65504;
const ROTATED_MAX = 1 << 16;

export class CodecError extends Error {}

export function checkCodec(codec) {
  if (!CODECS.includes(codec)) throw new CodecError(`unknown codec ${JSON.stringify(codec)}: choose one of ${CODECS.join(', ')}`);
  return codec;
}

const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);

/** The float32 next to float32 `x` towards +inf (up) or -inf (down): numpy's nextafter in float32. */
function nextFloat32(x, up) {
  if (x === 0) return up ? 2 ** -149 : -(2 ** -149);
  f32[0] = x;
  u32[0] += (x > 0) === up ? 1 : -1;
  return f32[0];
}

/** float32 -> float16 bits, round half to even (numpy's astype(float16)); |x| <= 65504 here. */
export function halfBits(x) {
  f32[0] = x;
  const bits = u32[0];
  const sign = (bits >>> 16) & 0x8000;
  const exp = (bits >>> 23) & 0xff;
  let mant = bits & 0x7fffff;
  if (exp === 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0);
  let e = exp - 127 + 15;
  if (e >= 0x1f) return sign | 0x7c00;
  if (e <= 0) { // a subnormal half (or zero): shift the mantissa with its implicit bit, then round
    if (e < -10) return sign;
    mant |= 0x800000;
    const shift = 14 - e;
    const half = mant >>> shift, rest = mant & ((1 << shift) - 1), mid = 1 << (shift - 1);
    return sign | (half + (rest > mid || (rest === mid && half & 1) ? 1 : 0));
  }
  const rest = mant & 0x1fff, mid = 0x1000;
  let out = (e << 10) | (mant >>> 13);
  if (rest > mid || (rest === mid && out & 1)) out += 1; // a carry into the exponent is right, up to infinity
  return sign | out;
}

const channels = (shape) => (shape.length >= 2 ? shape[0] : 1);

/** Banker's rounding, as np.rint. */
function rint(v) {
  const r = Math.round(v);
  return r - v === 0.5 && r % 2 !== 0 ? r - 1 : r;
}

function range(row) {
  let lo = Infinity, hi = -Infinity;
  for (let i = 0; i < row.length; i++) { if (row[i] < lo) lo = row[i]; if (row[i] > hi) hi = row[i]; }
  return row.length ? [lo, hi] : [0, 0];
}

/** (lo, scale) of one row as the float32 values sent, lo rounded down and scale up (compression._float32_grid). */
function float32Grid(row) {
  const [low, high] = range(row);
  let lo = Math.fround(low);
  if (lo > low) lo = nextFloat32(lo, false);
  const wide = (high - lo) / 255;
  let scale = Math.fround(wide);
  if (scale < wide) scale = nextFloat32(scale, true);
  return [lo, scale];
}

const HALF_STEPS = Array.from({ length: 256 }, (_, q) => q - 127.5);
export const GRID = HALF_STEPS.map((t) => 127.5 + 0.75 * t + t ** 3 / 65025);
const GRID_EDGES = GRID.slice(1).map((g, i) => (g + GRID[i]) / 2);

/** The GRID level nearest `steps`: how many edges lie below it. */
function nearestLevel(steps) {
  let lo = 0, hi = GRID_EDGES.length;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (GRID_EDGES[mid] < steps) lo = mid + 1; else hi = mid;
  }
  return lo;
}

const rotates = (n) => n >= 2 && n <= ROTATED_MAX && (n & (n - 1)) === 0;
const signCache = new Map();

/** s_i = -1 where bit i of SHAKE128("fedper int8-delta-rot") is set (least significant bit first), else +1. */
export function signs(n) {
  if (!signCache.has(n)) {
    const stream = shake128(new TextEncoder().encode('fedper int8-delta-rot'), (n + 7) >> 3);
    signCache.set(n, Float64Array.from({ length: n }, (_, i) => ((stream[i >> 3] >> (i & 7)) & 1 ? -1 : 1)));
  }
  return signCache.get(n);
}

/** In place: `row` <- row @ H (Sylvester's Hadamard matrix, n a power of two). */
function hadamard(row) {
  for (let h = 1; h < row.length; h *= 2) {
    for (let i = 0; i < row.length; i += 2 * h) {
      for (let j = i; j < i + h; j++) {
        const a = row[j], b = row[j + h];
        row[j] = a + b;
        row[j + h] = a - b;
      }
    }
  }
}

/** uint8 q and per-row (lo, scale) of a float32 tensor's change `d` (float32 values). */
function quantize(d, shape, codec) {
  const count = codec === 'int8' || codec === 'int8-delta' ? 1 : channels(shape);
  const width = count ? d.length / count : 0;
  const q = new Uint8Array(d.length), lo = [], scale = [];
  for (let c = 0; c < count; c++) {
    const row = Float64Array.from(d.subarray(c * width, (c + 1) * width));
    let l, s;
    if (codec === 'int8-delta-rot') {
      if (rotates(width)) {
        const sg = signs(width);
        for (let i = 0; i < width; i++) row[i] *= sg[i];
        hadamard(row);
        for (let i = 0; i < width; i++) row[i] /= width;
      }
      [l, s] = float32Grid(row);
      for (let i = 0; i < width; i++) q[c * width + i] = s > 0 ? nearestLevel((row[i] - l) / s) : 0;
    } else {
      if (codec === 'int8-delta-pc') {
        [l, s] = float32Grid(row);
      } else {
        const [low, high] = range(row);
        [l, s] = [low, (high - low) / 255];
      }
      for (let i = 0; i < width; i++) q[c * width + i] = s > 0 ? Math.min(255, Math.max(0, rint((row[i] - l) / s))) : 0;
    }
    lo.push(l);
    scale.push(s);
  }
  return { q, lo, scale };
}

function base64(bytes) {
  let s = '';
  for (let i = 0; i < bytes.length; i++) s += String.fromCharCode(bytes[i]);
  return btoa(s);
}

/** {arrays: [{name, dtype, shape, data}], metadata} of `tensors` ([{name, shape, data: Float32Array}], in the
 * manifest's order) under `codec`; `exact`: names sent float32 whatever the codec (BatchNorm statistics);
 * `reference`: Map(name -> Float32Array), the round's model a delta codec encodes against. */
export function encodeTensors(tensors, codec, exact = new Set(), reference = null) {
  checkCodec(codec);
  const arrays = [], quant = {};
  for (const { name, shape, data } of tensors) {
    if (!data.every(Number.isFinite)) throw new CodecError(`${name} holds NaN or Inf`);
    if (codec === 'fp32' || exact.has(name)) {
      arrays.push({ name, dtype: 'F32', shape, data });
    } else if (codec === 'fp16') {
      const fits = data.every((v) => Math.abs(v) <= FP16_MAX);
      arrays.push(fits ? { name, dtype: 'F16', shape, data: Uint16Array.from(data, halfBits) } : { name, dtype: 'F32', shape, data });
    } else {
      let d = data;
      if (DELTA_CODECS.includes(codec)) {
        const ref = reference?.get(name);
        if (!ref || ref.length !== data.length) throw new CodecError(`${name}: no reference tensor of ${data.length} values for codec ${codec}`);
        d = new Float32Array(data.length);
        for (let i = 0; i < d.length; i++) d[i] = data[i] - ref[i];
        if (!d.every(Number.isFinite)) throw new CodecError(`${name}: its difference from the reference overflows float32`);
      }
      const { q, lo, scale } = quantize(d, shape, codec);
      arrays.push({ name, dtype: 'U8', shape, data: q });
      if (PER_CHANNEL.includes(codec)) {
        const pairs = new Float32Array(2 * lo.length);
        lo.forEach((l, c) => { pairs[2 * c] = l; pairs[2 * c + 1] = scale[c]; });
        quant[name] = base64(new Uint8Array(pairs.buffer));
      } else {
        quant[name] = [lo[0], scale[0]];
      }
    }
  }
  if (codec === 'fp32') return { arrays, metadata: null };
  const metadata = { 'fedper.codec': codec };
  if (codec.startsWith('int8')) metadata['fedper.quant'] = JSON.stringify(quant);
  return { arrays, metadata };
}
