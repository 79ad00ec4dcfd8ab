// The web agent's protocol logic (docs/protocol.md, v1), the same state machine as fedper-agent's
// (edge/engine.py, its jobs in edge/agent.py): `connected()` and `handle(topic, payload)` return the messages to publish, so tests drive it
// with hand-built frames, and the MQTT client around it (transport.js) stays thin.
//
// Per round k (RoundInfo `open` for a round this device has not answered, and with selection once invited):
// collect the base model's chunks, check its sha256 against RoundInfo, decode it once (fp32, exactly the manifest's
// finite shared tensors), load the shared tensors by name (the head stays), evaluate on the local test split (the
// model the device serves now; FedBABU serves a fine-tuned copy), train the algorithm's phases, save the state in
// IndexedDB, publish the update: only the manifest's shared tensors (Updates.encode takes the manifest), chunked.
// After a reload the head comes back from the store; a saved update of the open round is sent again whenever that
// round's RoundInfo is (re)published, and so is one of an earlier round that asynchronous rounds (RoundInfo's
// max_staleness, docs/protocol.md 8.2) still take. What reaches the page is checked before anything is loaded.

import { DELTA_CODECS, encodeTensors } from './codecs.js';
import { encodeSafetensors, decodeSafetensors } from './safetensors.js';
import { Reassembler, Topics, WireError, chunkBlob, decodeChunk, decodeMessage, encodeMessage, messageFields } from './wire.js';

export const SOFTWARE = 'fedper-web/0.1.0';
const COORDINATOR_SOURCE_BLOBS = 4;
const PURPOSE_FINETUNE = 1000; // fedper.batches.PURPOSE_FINETUNE: the phase index of FedBABU's evaluation fine-tune

export class AgentError extends Error {}

export const DEFAULTS = {
  localEpochs: 1, batchSize: 32, lr: 0.01, seed: 0, codec: 'fp32', chunkSize: 63 * 1024,
  evalFinetuneEpochs: 1, evalFinetune: 'all', fineTuneHead: false,
};

/** The shared tensors of `tensors` (a Map by name) as one safetensors blob under `codec`: the manifest decides
 * what goes, so a head tensor cannot be sent (fedper.payload.encode_shared's rule). */
export function encodeShared(manifest, tensors, codec = 'fp32', reference = null) {
  const shared = manifest.sharedTensors;
  const local = [...tensors.keys()].filter((n) => !manifest.spec(n)?.shared);
  if (local.length) throw new AgentError(`refusing to encode tensors that are not shared: ${local.slice(0, 3).join(', ')}`);
  const missing = shared.filter((t) => !tensors.has(t.name)).map((t) => t.name);
  if (missing.length) throw new AgentError(`missing shared tensors ${missing.slice(0, 3).join(', ')}`);
  const exact = new Set(shared.filter((t) => !t.trainable).map((t) => t.name));
  const { arrays, metadata } = encodeTensors(shared.map((t) => ({ name: t.name, shape: t.shape, data: tensors.get(t.name) })),
    codec, exact, reference);
  return encodeSafetensors(arrays, metadata);
}

/** A round's model blob as the manifest's shared tensors (Map by name), each checked: fp32, the manifest's names,
 * shapes, float32, finite; WireError('bad_tensors') otherwise. */
export function decodeModel(manifest, blob) {
  let decoded;
  try {
    decoded = decodeSafetensors(blob);
  } catch (e) {
    throw new WireError('bad_tensors', `not a valid safetensors blob: ${e.message}`);
  }
  const codec = decoded.metadata['fedper.codec'] ?? 'fp32';
  if (codec !== 'fp32') throw new WireError('bad_tensors', `a round's model is fp32, this one is ${codec}`);
  const names = manifest.sharedTensors.map((t) => t.name);
  const extra = [...decoded.tensors.keys()].filter((n) => !names.includes(n));
  if (extra.length || decoded.tensors.size !== names.length) {
    throw new WireError('bad_tensors', `the model's tensors are not the manifest's shared ones (extra: ${extra.slice(0, 3).join(', ')})`);
  }
  const out = new Map();
  for (const t of manifest.sharedTensors) {
    const got = decoded.tensors.get(t.name);
    if (got.dtype !== 'F32' || got.shape.join(',') !== t.shape.join(',')) {
      throw new WireError('bad_tensors', `${t.name} is ${got.dtype}[${got.shape}], the manifest says float32[${t.shape}]`);
    }
    if (!got.data.every(Number.isFinite)) throw new WireError('bad_tensors', `${t.name} holds NaN or Inf`);
    out.set(t.name, got.data);
  }
  return out;
}

export class Agent {
  /** config: {fleet, clientId, ...DEFAULTS}; data: {xTrain, yTrain, xTest, yTest}; trainer: a Trainer;
   * store: IndexedDBStore or MemoryStore; log(line); random(n bytes) -> Uint8Array. */
  constructor({ config, manifest, trainer, data, store, log = console.log, random }) {
    this.config = { ...DEFAULTS, ...config };
    this.manifest = manifest;
    this.trainer = trainer;
    this.data = data;
    this.store = store;
    this.log = log;
    this.random = random ?? ((n) => crypto.getRandomValues(new Uint8Array(n)));
    this.topics = new Topics(this.config.fleet);
    this.phases = this.config.fineTuneHead && manifest.phases[0][0] !== 'head' ? [['head', 1], ...manifest.phases] : manifest.phases;
    this.serveTuned = manifest.fineTuneHeadAtEval && this.config.evalFinetuneEpochs > 0;
    const needed = new Set([...this.phases.map(([trained]) => trained), ...(this.serveTuned ? [this.config.evalFinetune] : [])]);
    const missing = [...needed].filter((k) => !(k in manifest.artifactSets));
    if (missing.length) throw new AgentError(`the algorithm's phases train ${missing} but the export has no such artifact set`);
    this.models = new Reassembler(manifest.maxBlobSize, COORDINATOR_SOURCE_BLOBS);
    this.saved = null;
    this.finalAccuracy = null;
    this.blob = null; // the newest complete model blob, until a RoundInfo names it
    this.model = null; // {blobId, sha256, tensors}: the open round's model, decoded
    this.round = null;
    this.sentRound = null;
    this.lastSent = 0; // the newest round this page (since its load) sent an update for; never reset, for observers
    this.invited = null;
    this.kept = null; // asynchronous rounds: {round, model} of the update sent last (a resend may need its model)
    this.quiet = null;
    this.noted = new Set();
    this.secureNoted = null;
    this.stopped = false;
  }

  get nSamples() { return this.data.yTrain.length; }

  /** Restore the head of the last completed round from the store; call once before connecting. */
  async restore() {
    const saved = await this.store.get('device');
    if (!saved) return;
    if (saved.baseDigest !== this.manifest.baseDigest) {
      this.log(`the stored state belongs to another export (${saved.baseDigest}): starting afresh`);
      return;
    }
    this.saved = saved;
    this.trainer.load(new Map(Object.entries(saved.local)));
    this.log(`restored the head of round ${saved.round} from this browser's storage`);
  }

  // ------------------------------------------------------------ messages in, messages out

  /** What to be subscribed to now: RoundInfo, errors and invitations always; the model's chunks once RoundInfo
   * says which (with selection: only while invited and without the model). */
  subscriptions() {
    const t = this.topics, me = this.config.clientId, info = this.round;
    const wanted = [t.round, t.error(me), t.invite(me)];
    if (info && info.selection === 'all') wanted.push(t.allModels);
    else if (info && this.wantsModel(info)) wanted.push(t.modelsOf(info.blob_id));
    return wanted;
  }

  /** Online and registered, on every connect; the retained RoundInfo then resends an unacknowledged update. */
  connected() {
    this.log('connected');
    return this.announce();
  }

  /** One message from the broker; the messages to publish in answer. AgentError when the agent cannot go on. */
  async handle(topic, payload) {
    const t = this.topics, me = this.config.clientId;
    try {
      if (topic === t.round) return await this.onRoundInfo(decodeMessage('RoundInfo', payload));
      if (topic.startsWith(`${t.base}/model/`)) return await this.onModelChunk(topic, payload);
      if (topic === t.error(me)) return await this.onError(decodeMessage('ErrorMessage', payload));
      if (topic === t.invite(me)) return await this.onInvitation(payload);
    } catch (e) {
      if (!(e instanceof WireError)) throw e;
      this.log(`ignored a bad message on ${topic}: ${e.message}`);
    }
    return [];
  }

  announce() {
    const t = this.topics, me = this.config.clientId;
    const register = encodeMessage('Register', { n_samples: this.nSamples, base_digest: this.manifest.baseDigest, software: SOFTWARE });
    return [{ topic: t.presence(me), payload: new TextEncoder().encode('online'), retain: true },
      { topic: t.register(me), payload: register, retain: true }];
  }

  async onRoundInfo(info) {
    const problem = this.roundInfoProblem(info);
    if (problem) {
      this.log(`ignored RoundInfo of round ${info.round} (${info.state}): ${problem}`);
      return [];
    }
    const again = this.round === null || this.round.round === info.round; // (re)published, or the first seen
    this.round = info;
    if (info.state === 'open' && !this.invitedTo(info) && this.quiet !== info.round) {
      this.quiet = info.round;
      const wait = (info.next_selection_at ?? info.deadline) - Date.now() / 1000;
      this.log(`round ${info.round}: not invited; quiet until an invitation or the next selection (due within ${Math.max(wait, 0).toFixed(0)} s)`);
    }
    this.sentRound = null; // v1 acknowledges no update: the saved one goes again whenever its round is re-announced
    const stale = again && this.lostStale(info) ? this.resendStale(info) : [];
    return [...stale, ...(await this.progress())];
  }

  /** Whether the saved update is of an earlier round that `info` (asynchronous: max_staleness) still takes and can
   * be encoded again (a delta codec needs the model it was trained on, kept in memory only). */
  lostStale(info) {
    const saved = this.saved;
    if (info.state !== 'open' || info.max_staleness === null || !saved) return false;
    if (!(info.round - info.max_staleness <= saved.round && saved.round < info.round)) return false;
    return this.kept?.round === saved.round || !DELTA_CODECS.includes(this.config.codec);
  }

  resendStale(info) {
    this.log(`round ${info.round}: sending the saved update of round ${this.saved.round} again (asynchronous rounds still take it; it may have been lost)`);
    const model = this.kept?.round === this.saved.round ? this.kept.model : null;
    return this.update(this.saved, model);
  }

  roundInfoProblem(info) {
    if (info.base_digest !== this.manifest.baseDigest) return `it is for another export (base_digest ${info.base_digest}, ours ${this.manifest.baseDigest})`;
    if (info.round > info.rounds) return `round ${info.round} of a run of ${info.rounds} rounds`;
    if (info.size > this.models.maxBlobSize) return `its model declares ${info.size} bytes, more than this model's shared tensors take (${this.models.maxBlobSize})`;
    if (info.state === 'open' && this.saved && info.round < this.saved.round) return `stale: this device already answered round ${this.saved.round}`;
    return null;
  }

  async onInvitation(payload) {
    if (!payload.length) {
      this.invited = null;
      return [];
    }
    const invitation = decodeMessage('Invitation', payload);
    this.invited = invitation.round;
    if (this.round && this.round.round === invitation.round) {
      this.log(`round ${invitation.round}: invited`);
      return this.progress();
    }
    return [];
  }

  invitedTo(info) { return info.selection === 'all' || this.invited === info.round; }

  /** Whether the model RoundInfo names is still needed: the final one until evaluated; an open round's while this
   * device takes part and has not sent its update. */
  wantsModel(info) {
    if (this.finalAccuracy !== null || this.holdsModel(info)) return false;
    if (info.state === 'finished') return true;
    const answered = this.saved && info.round === this.saved.round;
    return this.invitedTo(info) && !(answered && this.sentRound === info.round);
  }

  holdsModel(info) {
    return this.model !== null && this.model.blobId === info.blob_id && this.model.sha256 === info.sha256;
  }

  async onModelChunk(topic, payload) {
    if (!payload.length) return []; // an empty retained payload clears an old round's chunk
    const where = topic.slice(`${this.topics.base}/model/`.length).split('/');
    let blob;
    try {
      const chunk = decodeChunk(payload, this.models.maxBlobSize);
      if (where.length !== 2 || where[0] !== chunk.blobId || where[1] !== String(chunk.index)) {
        throw new WireError('bad_chunk', `chunk ${chunk.index} of blob ${chunk.blobId} on another blob's topic`);
      }
      blob = this.models.add(chunk);
    } catch (e) {
      if (!(e instanceof WireError)) throw e;
      this.refuseBlob(where[0], `ignored a bad model chunk on ${topic}: ${e.message}`);
      return [];
    }
    if (!blob) return [];
    this.noted.delete(blob.blobId);
    const info = this.round;
    if (info && blob.blobId === info.blob_id && blob.sha256 !== info.sha256) {
      this.refuseBlob(blob.blobId, `model ${blob.blobId} does not match the round's sha256: waiting for the right one`);
      return [];
    }
    this.blob = blob;
    return this.progress();
  }

  refuseBlob(blobId, line) {
    if (this.noted.has(blobId)) return;
    if (this.noted.size >= 64) this.noted.clear();
    this.noted.add(blobId);
    this.log(line);
  }

  async onError(error) {
    this.log(`coordinator: ${error.code}: ${error.message}`);
    if (error.code === 'digest_mismatch') throw new AgentError(`the coordinator refused this export: ${error.message}`);
    if ((error.code === 'unknown_device' || error.code === 'bad_chunk') && this.saved && error.round === this.saved.round) {
      this.sentRound = null; // register again, then send the update again (a fresh blob id)
      return [...this.announce(), ...(await this.progress())];
    }
    return [];
  }

  /** Act on the open round once its model is here: train and send, send the saved update again, or, for the
   * finished run, evaluate the final model. */
  async progress() {
    const info = this.round;
    if (!info || this.finalAccuracy !== null) return [];
    if (info.state === 'open' && !this.invitedTo(info)) return [];
    if (info.state === 'open' && info.secagg_session !== null) {
      if (this.secureNoted !== info.round) {
        this.secureNoted = info.round;
        this.log(`round ${info.round}: the coordinator runs secure aggregation, which the web agent does not do: not taking part`);
      }
      return [];
    }
    const answered = this.saved && info.state === 'open' && info.round === this.saved.round;
    if (answered && this.sentRound === info.round) return [];
    const model = this.roundModel(info);
    if (!model) return [];
    if (info.state === 'finished') {
      await this.finish(info, model);
      return [];
    }
    if (answered) {
      this.log(`round ${info.round}: already trained (before a reload, a reconnect or the round's re-publication), sending the saved update again`);
    } else {
      this.trainer.load(model);
      this.saved = await this.trainRound(info.round);
    }
    return this.update(this.saved, model);
  }

  roundModel(info) {
    if (this.holdsModel(info)) return this.model.tensors;
    const blob = this.blob;
    if (!blob || blob.blobId !== info.blob_id) return null;
    if (blob.sha256 !== info.sha256) {
      this.log(`model ${info.blob_id} does not match the round's sha256: waiting for the right one`);
      return null;
    }
    this.blob = null;
    this.model = null;
    let tensors;
    try {
      tensors = decodeModel(this.manifest, blob.data);
    } catch (e) {
      this.log(`refused model ${info.blob_id} of round ${info.round}: ${e.message}`);
      return null;
    }
    this.model = { blobId: info.blob_id, sha256: info.sha256, tensors };
    return tensors;
  }

  /** The chunk frames of `saved`, the update answering the round whose model is `model`. */
  update(saved, model) {
    const c = this.config;
    const meta = { round: saved.round, n_samples: saved.nSamples, base_digest: saved.baseDigest, metrics: saved.metrics, codec: c.codec };
    const hex = [...this.random(4)].map((b) => b.toString(16).padStart(2, '0')).join('');
    const reference = DELTA_CODECS.includes(c.codec) ? model : null;
    const blob = encodeShared(this.manifest, new Map(Object.entries(saved.update)), c.codec, reference);
    this.kept = this.round && this.round.max_staleness !== null && model ? { round: saved.round, model } : null;
    const frames = chunkBlob(blob, c.chunkSize, `r${saved.round}-${hex}`, messageFields('UpdateMeta', meta));
    this.sentRound = saved.round;
    this.lastSent = Math.max(this.lastSent, saved.round);
    return frames.map((payload) => ({ topic: this.topics.update(c.clientId), payload, retain: false }));
  }

  async finish(info, model) {
    this.trainer.load(model);
    await this.tuneForServing(info.rounds + 1); // the emulator's evaluation after round R keys it R + 1
    const { accuracy, loss } = await this.trainer.evaluate(this.data.xTest, this.data.yTest);
    this.log(`finished after ${info.rounds} rounds: personalized accuracy ${accuracy.toFixed(4)}`);
    const served = Object.fromEntries(this.trainer.read(this.manifest.names()));
    await this.store.put('final', { rounds: info.rounds, accuracy, loss, served });
    this.finalAccuracy = accuracy;
  }

  /** FedBABU: fine-tune the loaded model in place, as the device serves it; returns the untuned tensors. */
  async tuneForServing(round) {
    if (!this.serveTuned) return null;
    const c = this.config, d = this.data;
    const untuned = this.trainer.read(this.manifest.names());
    await this.trainer.train(c.evalFinetune, d.xTrain, d.yTrain, {
      epochs: c.evalFinetuneEpochs, batchSize: c.batchSize, lr: c.lr, seed: [c.seed, round, PURPOSE_FINETUNE],
    });
    return untuned;
  }

  /** Evaluate the served model, train every phase, save the state; the base is already loaded. */
  async trainRound(round) {
    const c = this.config, d = this.data;
    const untuned = d.yTest.length ? await this.tuneForServing(round) : null;
    const { accuracy, loss: testLoss } = await this.trainer.evaluate(d.xTest, d.yTest);
    if (untuned) this.trainer.load(untuned);
    let samples = 0, seconds = 0, trainLoss = NaN;
    for (const [index, [trained, epochs]] of this.phases.entries()) {
      const stats = await this.trainer.train(trained, d.xTrain, d.yTrain, {
        epochs: epochs ?? c.localEpochs, batchSize: c.batchSize, lr: c.lr, seed: [c.seed, round, index],
      });
      samples += stats.samples;
      seconds += stats.seconds;
      trainLoss = stats.loss;
    }
    const metrics = Object.fromEntries(Object.entries({
      accuracy, loss: testLoss, train_loss: trainLoss, samples_per_s: seconds ? samples / seconds : 0,
    }).filter(([, v]) => Number.isFinite(v)));
    const saved = {
      round, baseDigest: this.manifest.baseDigest, nSamples: this.nSamples, metrics,
      local: Object.fromEntries(this.trainer.read(this.manifest.names({ shared: false }))),
      update: Object.fromEntries(this.trainer.read(this.manifest.names({ shared: true }))),
    };
    await this.store.put('device', saved);
    this.log(`round ${round}: served accuracy ${accuracy.toFixed(4)} (test loss ${testLoss.toFixed(4)}); trained ${samples} samples in ${seconds.toFixed(1)} s (${(samples / Math.max(seconds, 1e-9)).toFixed(0)} samples/s), train loss ${trainLoss.toFixed(4)}`);
    return saved;
  }
}
