// The page's training thread: a module Web Worker that holds onnxruntime-web and the Trainer, so the page stays
// responsive while a round trains (a step is 0.1-1 s of wasm). It answers the page's WorkerTrainer (remote.js):
// {id, op, args} in, {id, result} or {id, error} out, and {progress} after every training step. A dedicated worker
// shares its page's cross-origin isolation, so wasm threads work here as they would on the page; onnxruntime-web
// finds its wasm and its own thread workers beside ort.training.wasm.mjs (dist/vendor/ort/). It keeps no state
// of its own: the page keeps IndexedDB.

import * as ort from './vendor/ort/ort.training.wasm.mjs';
import { httpFiles, openArtifacts } from './artifacts.js';
import { Trainer } from './trainer.js';

let trainer = null;

const ops = {
  /** Load and check the export, open its sessions: the parameters and how many threads onnxruntime-web runs. */
  async open({ artifacts, threads }) {
    ort.env.wasm.numThreads = threads;
    const { read, manifest } = await openArtifacts(httpFiles(artifacts));
    trainer = await Trainer.open(ort, manifest, read, { executionProviders: ['wasm'] });
    return { params: trainer.params, threads: ort.env.wasm.numThreads };
  },
  load({ tensors }) {
    trainer.load(tensors);
  },
  async train({ trained, x, y, options }) {
    const stats = await trainer.train(trained, x, y, { ...options, progress: (p) => postMessage({ progress: p }) });
    return { stats, params: trainer.params };
  },
  evaluate({ x, y }) {
    return trainer.evaluate(x, y);
  },
  logits({ x, tensors }) {
    return trainer.logits(x, tensors);
  },
};

// one request at a time: the panel's logits may be asked while a round trains, and both use the same sessions
let queue = Promise.resolve();
self.onmessage = ({ data: { id, op, args } }) => {
  queue = queue.then(async () => {
    try {
      postMessage({ id, result: await ops[op](args) });
    } catch (e) {
      postMessage({ id, error: e instanceof Error ? e.message : `onnxruntime-web failed (${e})` });
    }
  });
};
