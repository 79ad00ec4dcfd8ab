// manifest.json as the page reads it (fedper/manifest.py writes it): the tensors by name and role, which are
// shared (the only ones that may leave the page), the artifact sets, and where each tensor sits in the contiguous
// parameter buffer of onnxruntime-web (every tensor of the manifest, in manifest order).

import { sha256Hex } from './hash.js';

const FORMAT_VERSION = 1;

/** fedper/algorithms.py's phases: [trained, epochs (null: the run's local epochs)] per phase, and whether the
 * device serves a fine-tuned copy (FedBABU). tests/test_web.py checks this table against the Python one. */
export const ALGORITHMS = {
  fedavg: { phases: [['all', null]], fineTuneHeadAtEval: false },
  fedper: { phases: [['all', null]], fineTuneHeadAtEval: false },
  'fedper-ft': { phases: [['head', 1], ['all', null]], fineTuneHeadAtEval: false },
  fedbabu: { phases: [['base', null]], fineTuneHeadAtEval: true },
  fedrep: { phases: [['head', null], ['base', 1]], fineTuneHeadAtEval: false },
  'lg-fedavg': { phases: [['all', null]], fineTuneHeadAtEval: false },
};

export class ManifestError extends Error {}

/** fedper.manifest.layout_digest: sha256 over "name:d0,d1,...:dtype\n" of the given tensors. */
export function layoutDigest(tensors) {
  const text = tensors.map((t) => `${t.name}:${t.shape.join(',')}:${t.dtype}\n`).join('');
  return `sha256:${sha256Hex(new TextEncoder().encode(text))}`;
}

export class Manifest {
  /** From manifest.json's parsed body; ManifestError for a malformed one or a base_digest that does not match. */
  constructor(body) {
    if (body?.format_version !== FORMAT_VERSION) throw new ManifestError(`manifest format_version ${body?.format_version} is not ${FORMAT_VERSION}`);
    const { model, algorithm, tensors } = body;
    if (!model || !Array.isArray(tensors) || !ALGORITHMS[algorithm]) {
      throw new ManifestError(`malformed manifest or an algorithm the page does not run (${algorithm})`);
    }
    for (const t of tensors) {
      if (typeof t.name !== 'string' || !Array.isArray(t.shape) || !t.shape.every(Number.isInteger) || typeof t.shared !== 'boolean') {
        throw new ManifestError(`malformed tensor entry ${JSON.stringify(t).slice(0, 80)}`);
      }
      if (t.dtype !== 'float32') throw new ManifestError(`tensor ${t.name} is ${t.dtype}: the page trains float32 tensors`);
    }
    this.model = model;
    this.algorithm = algorithm;
    this.tensors = tensors;
    this.files = body.files ?? {};
    this.artifactSets = body.artifact_sets ?? {};
    this.baseDigest = layoutDigest(this.sharedTensors);
    if (body.base_digest !== undefined && body.base_digest !== this.baseDigest) {
      throw new ManifestError(`manifest base_digest ${body.base_digest} does not match its tensors (${this.baseDigest})`);
    }
    this.offsets = new Map();
    let offset = 0;
    for (const t of tensors) {
      const size = t.shape.reduce((a, b) => a * b, 1);
      this.offsets.set(t.name, [offset, size]);
      offset += size;
    }
    this.parameterCount = offset;
  }

  get sharedTensors() { return this.tensors.filter((t) => t.shared); }

  names({ shared = null } = {}) {
    return this.tensors.filter((t) => shared === null || t.shared === shared).map((t) => t.name);
  }

  spec(name) { return this.tensors.find((t) => t.name === name); }

  /** The label names; "0".."C-1" when the export named none (edge/agent.py manifest_classes). */
  get classes() {
    const c = this.model.classes ?? [];
    return c.length ? c : Array.from({ length: this.model.num_classes }, (_, i) => String(i));
  }

  get phases() { return ALGORITHMS[this.algorithm].phases; }

  get fineTuneHeadAtEval() { return ALGORITHMS[this.algorithm].fineTuneHeadAtEval; }

  /** The BatchNorm running statistics of the layers a phase training `trained` freezes (kept across it). */
  frozenStatistics(trained) {
    return this.tensors.filter((t) => !t.trainable && trained !== 'all' && trained !== t.role).map((t) => t.name);
  }

  /** fedper.payload.max_blob_size: the largest fp32 blob of the shared tensors, with room for its header. */
  get maxBlobSize() {
    const shared = this.sharedTensors;
    return shared.reduce((a, t) => a + 4 * t.shape.reduce((x, y) => x * y, 1), 0) + 256 * shared.length + 4096;
  }
}
