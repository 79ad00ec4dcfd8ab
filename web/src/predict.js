// The page's "what is this?" answer, the parts that need no browser: a photo's RGB bytes as the model's input (as
// the agent reads its training images: images.js) and one photo's logits as its most probable classes with their
// probabilities, as `fedper-agent predict` prints them (edge/personal.py top_classes).

import { resizeBilinear, toFloatNCHW } from './images.js';

/** RGB bytes (height x width x 3, row-major) of a photo of any size as the model's float32 NCHW input, one sample;
 * `model`: the manifest's model (input_shape, mean, std). */
export function photoInput(rgb, width, height, model) {
  const [, h, w] = model.input_shape;
  return toFloatNCHW(resizeBilinear(rgb, width, height, w, h), 1, h, w, model.mean, model.std);
}

/** Softmax of one row of logits, the largest subtracted first so that no exp overflows. */
export function softmax(logits) {
  const largest = Math.max(...logits);
  const exps = Array.from(logits, (v) => Math.exp(v - largest));
  const sum = exps.reduce((a, b) => a + b, 0);
  return exps.map((v) => v / sum);
}

/** The k most probable classes of one row of logits, most probable first (ties: the lower class index first):
 * [{name, probability}]. */
export function topClasses(logits, names, k) {
  if (logits.length !== names.length) throw new Error(`${logits.length} logits for ${names.length} class names`);
  return softmax(logits).map((probability, i) => ({ name: names[i], probability }))
    .sort((a, b) => b.probability - a.probability) // stable: ties keep the class order
    .slice(0, k);
}
