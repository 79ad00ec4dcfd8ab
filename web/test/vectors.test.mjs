// The page reproduces what the Python side computes (tests/vectors/web/, written by make_web_vectors.py):
// numpy's permutations, the batch order and the split; Pillow's resize and the normalization; every codec.

import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'node:test';

import { GRID, encodeTensors, halfBits, signs } from '../src/codecs.js';
import { resizeBilinear, toFloatNCHW } from '../src/images.js';
import { PCG64, epochBatches, splitTrainTest } from '../src/rng.js';
import { VECTORS } from './helpers.mjs';

const load = (name) => JSON.parse(readFileSync(join(VECTORS, 'web', `${name}.json`)));

test('permutations, batches and splits are numpy\'s', () => {
  const v = load('rng');
  for (const c of v.permutations) assert.deepEqual(new PCG64(c.seed).permutation(c.n), c.perm, `seed ${c.seed}, n ${c.n}`);
  for (const c of v.batches) assert.deepEqual(epochBatches(c.n, c.batch_size, c.seed), c.batches);
  for (const c of v.splits) assert.deepEqual(splitTrainTest(c.labels, 0.2, c.seed), { train: c.train, test: c.test });
  assert.equal(v.permutations.length, 28);
});

test('images are resized as Pillow resizes them and normalized as to_float_nchw does', () => {
  const v = load('images');
  for (const c of v.resizes) {
    const out = resizeBilinear(Uint8Array.from(c.pixels), c.width, c.height, c.out_width, c.out_height);
    assert.deepEqual([...out], c.resized, `${c.width}x${c.height} -> ${c.out_width}x${c.out_height}`);
  }
  const n = v.normalize, [count, height, width] = n.shape;
  const out = toFloatNCHW(Uint8Array.from(n.pixels), count, height, width, n.mean, n.std);
  assert.deepEqual([...out], n.values.map(Math.fround));
});

test('float32 to float16 rounds as numpy does, ties to even and subnormals included', () => {
  const { float16 } = load('codecs');
  assert.deepEqual(float16.float32.map(halfBits), float16.bits);
});

test('the rotation signs and the grid are the protocol\'s', () => {
  assert.deepEqual([...signs(8)], [1, -1, 1, 1, -1, -1, -1, 1]); // docs/protocol.md 7.1
  assert.equal(GRID[0], 0);
  assert.equal(GRID[255], 255);
  assert.ok(Math.abs(GRID[128] - GRID[127] - 0.75) < 1e-4);
});

test('every codec encodes as fedper.compression does', () => {
  const v = load('codecs');
  const tensors = Object.keys(v.trained).map((name) => ({ name, shape: v.shapes[name], data: Float32Array.from(v.trained[name]) }));
  const reference = new Map(Object.entries(v.reference).map(([n, x]) => [n, Float32Array.from(x)]));
  for (const [codec, expected] of Object.entries(v.encodings)) {
    const { arrays, metadata } = encodeTensors(tensors, codec, new Set(v.exact), reference);
    const dtypes = { F32: 'float32', F16: 'float16', U8: 'uint8' };
    assert.deepEqual(arrays.map((a) => a.name), Object.keys(expected.arrays), codec);
    if (codec === 'fp32') assert.equal(metadata, null); // encode_shared writes plain safetensors for fp32
    else assert.equal(metadata['fedper.codec'], codec);
    const quant = metadata?.['fedper.quant'] ? JSON.parse(metadata['fedper.quant']) : {};
    const want = expected.metadata['fedper.quant'] ? JSON.parse(expected.metadata['fedper.quant']) : {};
    assert.deepEqual(Object.keys(quant), Object.keys(want), codec);
    for (const a of arrays) {
      const e = expected.arrays[a.name];
      assert.equal(dtypes[a.dtype], e.dtype, `${codec} ${a.name}`);
      assert.deepEqual(a.shape, e.shape);
      const values = a.dtype === 'F32' ? [...a.data] : [...a.data];
      const wanted = a.dtype === 'F32' ? e.values.map(Math.fround) : e.values;
      if (codec !== 'int8-delta-rot' || !(a.name in quant)) {
        assert.deepEqual(values, wanted, `${codec} ${a.name}`);
        assert.deepEqual(quant[a.name], want[a.name], `${codec} ${a.name} parameters`);
        continue;
      }
      // the rotation sums in another order than numpy's BLAS: a level may differ by one, the parameters by an ulp
      const off = values.filter((q, i) => q !== wanted[i]);
      assert.ok(values.every((q, i) => Math.abs(q - wanted[i]) <= 1), `${codec} ${a.name}`);
      assert.ok(off.length <= Math.max(1, values.length / 100), `${codec} ${a.name}: ${off.length} levels differ`);
      const pairs = (b64) => new Float32Array(Uint8Array.from(atob(b64), (ch) => ch.charCodeAt(0)).buffer);
      const [mine, theirs] = [pairs(quant[a.name]), pairs(want[a.name])];
      mine.forEach((p, i) => assert.ok(Math.abs(p - theirs[i]) <= Math.abs(theirs[i]) * 2.4e-7, `${codec} ${a.name} parameter ${i}`));
    }
  }
});
