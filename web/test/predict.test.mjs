// The "what is this?" panel's pure parts against values worked out by hand.
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { photoInput, softmax, topClasses } from '../src/predict.js';

const close = (actual, expected, tolerance = 1e-12) => {
  assert.equal(actual.length, expected.length);
  actual.forEach((v, i) => assert.ok(Math.abs(v - expected[i]) <= tolerance, `${i}: ${v} against ${expected[i]}`));
};

test('softmax: exp(logit) over their sum, with no overflow for large logits', () => {
  close(softmax([0, Math.log(2), Math.log(3), 0]), [1 / 7, 2 / 7, 3 / 7, 1 / 7]); // e^z = 1, 2, 3, 1
  close(softmax(Float32Array.of(1000, 1000 + Math.log(4))), [1 / 5, 4 / 5], 1e-6); // exp(1000) alone is Infinity
});

test('top classes: the most probable first, with their names; ties keep the class order', () => {
  const names = ['cat', 'dog', 'ship', 'frog'];
  const top = topClasses([0, Math.log(2), Math.log(3), 0], names, 3);
  assert.deepEqual(top.map((c) => c.name), ['ship', 'dog', 'cat']); // cat and frog tie at 1/7: cat comes first
  close(top.map((c) => c.probability), [3 / 7, 2 / 7, 1 / 7]);
  assert.equal(topClasses([5, 1], ['a', 'b'], 9).length, 2);
  assert.throws(() => topClasses([1, 2], names, 1), /2 logits for 4 class names/);
});

test('a photo becomes the model input: Pillow-bilinear resize, then (x / 255 - mean) / std per channel, NCHW', () => {
  const model = { input_shape: [3, 1, 1], mean: [0.5, 0.25, 0], std: [0.5, 0.25, 1] };
  // 2x2 pixels, every channel alike: 10 20 / 30 41. Halving averages two pixels with weights 1/2 each, rounding half
  // up to 8 bits after each pass: rows (10+20)/2 = 15 and (30+41)/2 = 35.5 -> 36, then (15+36)/2 = 25.5 -> 26.
  const rgb = Uint8Array.from([10, 20, 30, 41].flatMap((v) => [v, v, v]));
  const x = photoInput(rgb, 2, 2, model);
  close(x, [(26 / 255 - 0.5) / 0.5, (26 / 255 - 0.25) / 0.25, 26 / 255], 1e-6);
  // at the input size already: no resize, and the channels come out as planes (NCHW)
  const same = photoInput(Uint8Array.from([255, 0, 51]), 1, 1, model);
  close(same, [1, -1, 0.2], 1e-6);
});
