// The page's local data, as edge/agent.py load_local_data makes it from an image folder: images in the order a
// folder tree is read (class name, then file name), labels mapped onto the manifest's classes, a train/test split
// chosen once (stratified, seeded: fedper.data.split_train_test) and kept with a fingerprint of the images, and
// the float32 input the model takes. Same images and seed as a fedper-agent: the same samples in the same order.

import { sha256Hex } from './hash.js';
import { splitTrainTest } from './rng.js';
import { toFloatNCHW } from './images.js';

export const TEST_FRACTION = 0.2; // edge/state.py TEST_FRACTION

export class DataError extends Error {}

const byCodePoint = (a, b) => (a < b ? -1 : a > b ? 1 : 0);

/** sha256 of the images' bytes then the labels as int64 little-endian (edge/state.py data_fingerprint). */
export function dataFingerprint(pixels, labels) {
  const all = new Uint8Array(pixels.length + 8 * labels.length);
  all.set(pixels);
  new BigInt64Array(all.buffer, pixels.length).set(labels.map(BigInt));
  return `sha256:${sha256Hex(all)}`;
}

/** images: [{name, label (a class name), pixels (height x width x 3 bytes at the model's input size)}];
 * store: where the split is kept ('split'). {xTrain, yTrain, xTest, yTest}: float32 NCHW and class indices. */
export async function localData(images, manifest, store, seed, log = () => {}) {
  const [, height, width] = manifest.model.input_shape;
  const classes = manifest.classes;
  const unknown = [...new Set(images.map((im) => im.label))].filter((c) => !classes.includes(c));
  if (unknown.length) throw new DataError(`class(es) ${unknown.join(', ')} are not among the model's classes ${classes.join(', ')}`);
  if (!images.length) throw new DataError('no training images');
  const ordered = [...images].sort((a, b) => byCodePoint(a.label, b.label) || byCodePoint(a.name, b.name));
  const size = height * width * 3;
  const pixels = new Uint8Array(ordered.length * size);
  ordered.forEach((im, i) => {
    if (im.pixels.length !== size) throw new DataError(`${im.name} is not ${width}x${height} RGB`);
    pixels.set(im.pixels, i * size);
  });
  const labels = ordered.map((im) => classes.indexOf(im.label));
  const fingerprint = dataFingerprint(pixels, labels);
  let split = await store.get('split');
  if (!split || split.fingerprint !== fingerprint || split.seed !== seed) {
    if (split) log('the images changed since the train/test split was chosen: choosing it again');
    const { train, test } = splitTrainTest(labels, TEST_FRACTION, seed);
    split = { seed, n: labels.length, fingerprint, train, test };
    await store.put('split', split);
  }
  const { mean, std } = manifest.model;
  const x = toFloatNCHW(pixels, labels.length, height, width, mean, std);
  const take = (indices) => {
    const out = new Float32Array(indices.length * 3 * height * width);
    indices.forEach((sample, k) => out.set(x.subarray(sample * 3 * height * width, (sample + 1) * 3 * height * width), k * 3 * height * width));
    return out;
  };
  if (!split.train.length) throw new DataError('no training images after the test split');
  return {
    xTrain: take(split.train), yTrain: split.train.map((i) => labels[i]),
    xTest: take(split.test), yTest: split.test.map((i) => labels[i]),
  };
}
