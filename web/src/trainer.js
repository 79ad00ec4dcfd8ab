// Local training in onnxruntime-web 1.19.2 over the export's artifact sets, as edge/ort_backend.py does it in
// Python: one training session per set ("all", "head", "base": requires_grad is baked into each), the set trained
// last holding the current tensors. The web API has no by-name access, so the trainer keeps the whole model as the
// contiguous parameter buffer (every manifest tensor, in manifest order: Manifest.offsets) and copies that buffer
// into the set it trains next. The learning rate goes in as the web training graph's input (fedper-export writes
// training_model.web.onnx). A layer frozen in a phase keeps its BatchNorm running statistics.

import { epochBatches } from './rng.js';

export const EVAL_BATCH = 256; // fedper.batches.EVAL_BATCH: under --bn batch it sets the statistics
export const WEB_TRAINING_MODEL = 'training_model.web.onnx'; // fedper.artifacts.WEB_TRAINING_MODEL
const SET_FILES = { checkpointState: 'checkpoint', trainModel: WEB_TRAINING_MODEL, evalModel: 'eval_model.onnx', optimizerModel: 'optimizer_model.onnx' };

export class TrainerError extends Error {}

/** The model as the contiguous parameter buffer (every manifest tensor, in manifest order), by name: what the agent
 * loads and reads. The Trainer holds one beside its sessions; the page's WorkerTrainer (worker.js) a copy of the
 * worker's. */
export class Parameters {
  constructor(manifest, params) {
    this.manifest = manifest;
    this.params = params; // Float32Array: the current value of every manifest tensor
  }

  /** Overwrite the named tensors (Map or object of name -> Float32Array). */
  load(tensors) {
    for (const [name, value] of tensors instanceof Map ? tensors : Object.entries(tensors)) {
      const [offset, size] = this.offset(name);
      if (value.length !== size) throw new TrainerError(`${name}: ${value.length} values, the manifest says ${size}`);
      this.params.set(value, offset);
    }
  }

  /** Copies of the named tensors as they are now. */
  read(names) {
    return new Map(names.map((name) => {
      const [offset, size] = this.offset(name);
      return [name, this.params.slice(offset, offset + size)];
    }));
  }

  offset(name) {
    const at = this.manifest.offsets.get(name);
    if (!at) throw new TrainerError(`no tensor ${name} in the manifest`);
    return at;
  }
}

export class Trainer extends Parameters {
  constructor(ort, manifest, sessions, params) {
    super(manifest, params);
    this.ort = ort;
    this.sessions = sessions; // kind -> TrainingSession
    this.synced = new Set(sessions.keys()); // the sets whose session holds `params`
    this.current = sessions.has('all') ? 'all' : sessions.keys().next().value;
  }

  /** Every artifact set of the manifest as a training session; `read(path)` gives a file of the export as bytes
   * (already checked against the manifest's sha256). */
  static async open(ort, manifest, read, sessionOptions = {}) {
    const sets = Object.entries(manifest.artifactSets);
    if (!sets.length) throw new TrainerError('the manifest lists no training artifact sets');
    const sessions = new Map();
    let params = null;
    for (const [kind, folder] of sets) {
      const files = {};
      for (const [key, name] of Object.entries(SET_FILES)) files[key] = await read(`${folder}/${name}`);
      const session = await ort.TrainingSession.create(files, sessionOptions);
      const size = await session.getParametersSize(false);
      if (size !== manifest.parameterCount) {
        throw new TrainerError(`${folder} holds ${size} parameter values, the manifest's tensors ${manifest.parameterCount}`);
      }
      const buffer = (await session.getContiguousParameters(false)).data;
      if (params === null) params = Float32Array.from(buffer);
      else if (!buffer.every((v, i) => Object.is(v, params[i]))) {
        throw new TrainerError(`${folder}'s checkpoint does not hold the other sets' tensors in the same order`);
      }
      sessions.set(kind, session);
    }
    return new Trainer(ort, manifest, sessions, params);
  }

  /** Overwrite the named tensors; no session holds them until used. */
  load(tensors) {
    super.load(tensors);
    this.synced.clear();
  }

  async use(kind) {
    const session = this.sessions.get(kind);
    if (!session) {
      throw new TrainerError(`the artifacts have no set training '${kind}' (they have ${[...this.sessions.keys()].join(', ')}); re-export for algorithm ${this.manifest.algorithm}`);
    }
    if (!this.synced.has(kind)) {
      await session.loadParametersBuffer(new Uint8Array(this.params.buffer, this.params.byteOffset, this.params.byteLength), false);
      this.synced.add(kind);
    }
    this.current = kind;
    return session;
  }

  /** Plain SGD on the `trained` tensors over the kernel's batch order, keyed [...seed, epoch];
   * x: float32 NCHW samples, y: labels; progress({trained, epoch, epochs, step, steps, samplesPerS, secondsLeft})
   * after every step. {samples, seconds, loss (mean over batches)}. */
  async train(trained, x, y, { epochs, batchSize, lr, seed, progress = () => {} }) {
    const kept = this.read(this.manifest.frozenStatistics(trained));
    const session = await this.use(trained);
    const rate = new this.ort.Tensor('float32', new Float32Array([lr]), []);
    const start = performance.now();
    const losses = [];
    let samples = 0, step = 0;
    for (let epoch = 0; epoch < epochs; epoch++) {
      const batches = epochBatches(y.length, batchSize, [...seed, epoch]);
      const steps = epochs * batches.length; // every epoch has as many batches
      for (const batch of batches) {
        const out = await session.runTrainStep({ ...this.batch(x, y, batch), learning_rate: rate });
        losses.push(out[session.trainingOutputNames[0]].data[0]);
        await session.runOptimizerStep();
        await session.lazyResetGrad();
        samples += batch.length;
        step += 1;
        const seconds = (performance.now() - start) / 1000;
        progress({ trained, epoch: epoch + 1, epochs, step, steps, samplesPerS: samples / seconds, secondsLeft: (seconds / step) * (steps - step) });
      }
    }
    this.params = Float32Array.from((await session.getContiguousParameters(false)).data);
    this.synced = new Set([trained]);
    this.load(kept);
    const seconds = (performance.now() - start) / 1000;
    return { samples, seconds, loss: losses.length ? losses.reduce((a, b) => a + b, 0) / losses.length : NaN };
  }

  /** (accuracy, mean loss) of the model as it is now, in inference mode, over chunks of EVAL_BATCH. */
  async evaluate(x, y) {
    if (!y.length) return { accuracy: NaN, loss: NaN };
    const session = await this.use(this.current);
    const classes = this.manifest.model.num_classes;
    let correct = 0, lossSum = 0;
    for (let i = 0; i < y.length; i += EVAL_BATCH) {
      const idx = Array.from({ length: Math.min(EVAL_BATCH, y.length - i) }, (_, k) => i + k);
      const out = await session.runEvalStep(this.batch(x, y, idx));
      const [lossName, logitsName] = session.evalOutputNames;
      const logits = out[logitsName].data;
      idx.forEach((sample, k) => {
        let best = 0;
        for (let c = 1; c < classes; c++) if (logits[k * classes + c] > logits[k * classes + best]) best = c;
        if (best === y[sample]) correct += 1;
      });
      lossSum += out[lossName].data[0] * idx.length;
    }
    return { accuracy: correct / y.length, loss: lossSum / y.length };
  }

  /** One batch's logits (float32, samples x classes) in inference mode under `tensors` (every manifest tensor): the
   * page's "what is this?" with the served model. The trainer's own parameters stay as they were. */
  async logits(x, tensors) {
    const [c, h, w] = this.manifest.model.input_shape;
    const n = x.length / (c * h * w);
    const kept = this.params.slice();
    this.load(tensors);
    try {
      const session = await this.use(this.current);
      const out = await session.runEvalStep(this.batch(x, new Array(n).fill(0), [...Array(n).keys()]));
      return Float32Array.from(out[session.evalOutputNames[1]].data);
    } finally {
      this.params = kept;
      this.synced.clear();
    }
  }

  batch(x, y, indices) {
    const [c, h, w] = this.manifest.model.input_shape;
    const size = c * h * w;
    const input = new Float32Array(indices.length * size);
    indices.forEach((sample, k) => input.set(x.subarray(sample * size, (sample + 1) * size), k * size));
    const labels = BigInt64Array.from(indices, (sample) => BigInt(y[sample]));
    return {
      input: new this.ort.Tensor('float32', input, [indices.length, c, h, w]),
      labels: new this.ort.Tensor('int64', labels, [indices.length]),
    };
  }
}
