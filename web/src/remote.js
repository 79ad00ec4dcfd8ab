// The page's side of the training worker (worker.js): the Trainer's interface (load, read, train, evaluate, logits), with
// the work done in the worker and a copy of its parameter buffer kept here, so that load and read stay synchronous
// for the agent. Requests are answered in the order sent; a load goes with the next request.

import { Parameters, TrainerError } from './trainer.js';

export class WorkerTrainer extends Parameters {
  constructor(worker, manifest, params, threads) {
    super(manifest, params);
    this.worker = worker;
    this.threads = threads; // how many wasm threads onnxruntime-web runs in the worker
    this.progress = null; // the running train call's last step ({trained, epoch, epochs, step, steps, ...}), else null
    this.onProgress = () => {};
    this.pending = new Map(); // request id -> {resolve, reject}
    this.next = 0;
    worker.onmessage = ({ data }) => {
      if (data.progress) {
        this.progress = data.progress;
        this.onProgress(data.progress);
        return;
      }
      const waiting = this.pending.get(data.id);
      this.pending.delete(data.id);
      if ('error' in data) waiting.reject(new TrainerError(data.error));
      else waiting.resolve(data.result);
    };
    worker.onerror = (e) => {
      for (const waiting of this.pending.values()) waiting.reject(new TrainerError(`the training worker failed: ${e.message}`));
      this.pending.clear();
    };
  }

  /** A worker running worker.js with the export under `artifacts` (a URL) open on `threads` wasm threads. */
  static async open(manifest, artifacts, threads) {
    const worker = new Worker(new URL('./worker.js', import.meta.url), { type: 'module' });
    const trainer = new WorkerTrainer(worker, manifest, null, threads);
    const opened = await trainer.call('open', { artifacts: String(artifacts), threads });
    trainer.params = opened.params;
    trainer.threads = opened.threads;
    return trainer;
  }

  call(op, args) {
    const id = this.next++;
    return new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject });
      this.worker.postMessage({ id, op, args });
    });
  }

  load(tensors) {
    super.load(tensors); // checked here, where the agent can catch it
    this.call('load', { tensors }).catch(() => {}); // cannot fail once checked; the next request waits for it
  }

  async train(trained, x, y, options) {
    try {
      const { stats, params } = await this.call('train', { trained, x, y, options });
      this.params = params;
      return stats;
    } finally {
      this.progress = null;
      this.onProgress(null);
    }
  }

  evaluate(x, y) {
    return this.call('evaluate', { x, y });
  }

  logits(x, tensors) {
    return this.call('logits', { x, tensors });
  }
}
