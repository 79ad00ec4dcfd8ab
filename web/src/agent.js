// The web agent's protocol logic (docs/protocol.md, v1). AgentEngine is fedper-agent's state machine (edge/engine.py)
// in JavaScript, phase for phase and row for row: events in, messages and jobs out, no I/O; the scenario vectors
// written from the Python engine (tests/vectors/scenarios/, replayed by web/test/scenarios.test.mjs) hold both to
// one contract. Agent runs its jobs (check the conditions, train, evaluate the final model) as edge/agent.py does:
// `connected()` and `handle(topic, payload)` return the messages to publish, and the MQTT client around it
// (transport.js) stays thin.
//
// Per round k (RoundInfo `open` for a round this device has not answered, and with selection once invited):
// collect the base model's chunks, check its sha256 against RoundInfo, decode it once (fp32, exactly the manifest's
// finite shared tensors), load the shared tensors by name (the head stays), evaluate on the local test split (the
// model the device serves now; FedBABU serves a fine-tuned copy), train the algorithm's phases, save the state in
// IndexedDB, publish the update: only the manifest's shared tensors (encodeShared takes the manifest), chunked.
// After a reload the head comes back from the store; a saved update of the open round is sent again whenever that
// round's RoundInfo is (re)published, and so is one of an earlier round that asynchronous rounds (RoundInfo's
// max_staleness, docs/protocol.md 8.2) still take. What reaches the page is checked before anything is loaded.

import { chanceWords } from './chance.js';
import { DELTA_CODECS, encodeTensors } from './codecs.js';
import { encodeSafetensors, decodeSafetensors } from './safetensors.js';
import { DEFAULT_CHUNK_SIZE, Reassembler, Topics, WireError, chunkBlob, decodeChunk, decodeMessage, encodeMessage, messageFields } from './wire.js';

export const SOFTWARE = 'fedper-web/0.1.0';
const COORDINATOR_SOURCE_BLOBS = 4;
const MAX_NOTED_BLOBS = 64; // blob ids whose refusal was logged (one line per blob, not per chunk)
const PURPOSE_FINETUNE = 1000; // fedper.batches.PURPOSE_FINETUNE: the phase index of FedBABU's evaluation fine-tune

export class AgentError extends Error {}

const utf8 = (text) => new TextEncoder().encode(text);

export const DEFAULTS = {
  localEpochs: 1, batchSize: 32, lr: 0.01, seed: 0, codec: 'fp32', chunkSize: 63 * 1024,
  evalFinetuneEpochs: 1, evalFinetune: 'all', fineTuneHead: false,
};

// RoundInfo's training settings (the coordinator's, for its whole fleet) and the page's own settings they replace
const SENT = [['lr', 'lr'], ['local_epochs', 'localEpochs'], ['batch_size', 'batchSize']];

/** What a round trains with: the page's own settings, replaced by those the coordinator sends with the round
 * (edge/agent.py LocalTraining.of_round). */
export function roundTraining(info, own) {
  const training = { lr: own.lr, localEpochs: own.localEpochs, batchSize: own.batchSize };
  for (const [field, name] of SENT) if (info[field] !== null && info[field] !== undefined) training[name] = info[field];
  return training;
}

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

// ------------------------------------------------------------ the machine (edge/engine.py's, name for name)
//
// Events in: {type: 'connected'}, {type: 'tick'}, {type: 'message', topic, payload}, and the results of the jobs it
// asked for: {type: 'checked', job, problem}, {type: 'trained', job, saved}, {type: 'evaluated', job, accuracy}.
// Actions out: messages to publish {topic, payload, retain} and jobs {job: 'check', round}, {job: 'train', info,
// model}, {job: 'evaluate', info, model}. tests/vectors/scenarios/ (written from edge/engine.py) pin both machines.

export const Phase = Object.freeze({
  IDLE: 'idle', CHECKING: 'checking', DOWNLOADING: 'downloading', RESENDING: 'resending', TRAINING: 'training',
  ANSWERED: 'answered', FINAL_DOWNLOAD: 'final download', EVALUATING: 'evaluating', DONE: 'done',
});
export const Event = Object.freeze({
  NOT_ASKED: 'not asked', UNCHECKED: 'unchecked', INELIGIBLE: 'ineligible', ROUND_OPEN: 'round open',
  ROUND_ANSWERED: 'round answered', FINISHED: 'finished', CONNECTED: 'connected', INVITED: 'invited',
  UNINVITED: 'uninvited', BLOB: 'blob', RESEND: 'resend', RESEND_STALE: 'resend stale', RECHECK: 'recheck',
  MODEL: 'model', CHECKED: 'checked', TRAINED: 'trained', TRAINED_LATE: 'trained late', EVALUATED: 'evaluated',
});
export const Step = Object.freeze({
  ANNOUNCE: 'announce', CHECK: 'check', DECIDE: 'decide', FETCH: 'fetch', TRAIN: 'train', SEND: 'send',
  SEND_AGAIN: 'send again', SEND_STALE: 'send stale', EVALUATE: 'evaluate',
});

const P = Phase, E = Event, S = Step;
const WAITING = [P.IDLE, P.DOWNLOADING, P.RESENDING, P.ANSWERED, P.FINAL_DOWNLOAD]; // waiting on a message
const BUSY = [P.CHECKING, P.TRAINING, P.EVALUATING]; // a job is out: what changes meanwhile is decided when it returns
const FETCHING = [P.DOWNLOADING, P.RESENDING, P.FINAL_DOWNLOAD]; // the subscriptions ask for the round's model
const FOLLOW = [ // a phase waiting on a message follows what the open round asks
  [E.NOT_ASKED, P.IDLE, []], [E.INELIGIBLE, P.IDLE, []], [E.UNCHECKED, P.CHECKING, [S.CHECK]],
  [E.ROUND_OPEN, P.DOWNLOADING, [S.FETCH]], [E.ROUND_ANSWERED, P.RESENDING, [S.FETCH]],
  [E.FINISHED, P.FINAL_DOWNLOAD, [S.FETCH]],
];
const row = (phase, event, next, steps) => [`${phase}|${event}`, [next, steps]];
/** (phase, event) -> [next phase, steps in order], edge/engine.py's TRANSITIONS; a pair not listed changes nothing. */
export const TRANSITIONS = new Map([
  ...WAITING.flatMap((phase) => FOLLOW.map(([event, next, steps]) => row(phase, event, next, steps))),
  ...[...WAITING, ...BUSY].filter((p) => p !== P.IDLE).map((phase) => row(phase, E.CONNECTED, phase, [S.ANNOUNCE])),
  row(P.IDLE, E.CONNECTED, P.CHECKING, [S.ANNOUNCE, S.CHECK]),
  row(P.IDLE, E.RECHECK, P.CHECKING, [S.CHECK]),
  row(P.IDLE, E.INVITED, P.IDLE, [S.DECIDE]),
  row(P.DOWNLOADING, E.UNINVITED, P.IDLE, []),
  row(P.RESENDING, E.UNINVITED, P.IDLE, []),
  ...FETCHING.map((phase) => row(phase, E.BLOB, phase, [S.FETCH])),
  row(P.DOWNLOADING, E.MODEL, P.TRAINING, [S.TRAIN]),
  row(P.RESENDING, E.MODEL, P.ANSWERED, [S.SEND_AGAIN]),
  row(P.FINAL_DOWNLOAD, E.MODEL, P.EVALUATING, [S.EVALUATE]),
  ...WAITING.map((phase) => row(phase, E.RESEND, phase, [S.ANNOUNCE, S.DECIDE])),
  ...BUSY.map((phase) => row(phase, E.RESEND, phase, [S.ANNOUNCE])),
  ...WAITING.map((phase) => row(phase, E.RESEND_STALE, phase, [S.SEND_STALE])),
  row(P.CHECKING, E.CHECKED, P.IDLE, [S.DECIDE]),
  row(P.TRAINING, E.TRAINED, P.ANSWERED, [S.SEND]),
  row(P.TRAINING, E.TRAINED_LATE, P.ANSWERED, [S.SEND, S.DECIDE]),
  row(P.EVALUATING, E.EVALUATED, P.DONE, []),
]);

/** One device's side of the protocol, as edge/engine.py's AgentEngine: what it knows of the coordinator's rounds,
 * its saved update and its eligibility. settings: {clientId, fleet, nSamples, chunkSize, codec, conditions,
 * recheckS}; saved: the last trained round (the store's `device` record) or null; random(n) -> n random bytes. */
export class AgentEngine {
  constructor({ manifest, settings, saved = null, log = console.log, random }) {
    this.manifest = manifest;
    this.settings = { chunkSize: DEFAULT_CHUNK_SIZE, codec: 'fp32', conditions: false, recheckS: 60, ...settings };
    this.saved = saved;
    this.log = log;
    this.random = random ?? ((n) => crypto.getRandomValues(new Uint8Array(n)));
    this.topics = new Topics(this.settings.fleet);
    this.phase = P.IDLE;
    this.finalAccuracy = null;
    this.now = 0;
    this.models = new Reassembler(manifest.maxBlobSize, COORDINATOR_SOURCE_BLOBS);
    this.blob = null; // the newest complete model blob, until a RoundInfo names it
    this.model = null; // {blobId, sha256, tensors}: the open round's model, decoded
    this.round = null; // the newest RoundInfo that passed its checks
    this.training = null; // the train job out, until its update is sent
    this.kept = null; // asynchronous rounds: the job of the update sent last (its model)
    this.invited = null; // the round of this device's newest invitation
    this.eligible = !this.settings.conditions; // the conditions' last verdict: offline until first checked
    this.accepted = null; // the round the conditions were found to hold for: not checked again
    this.recheckAt = null; // while not eligible: when to check again
    this.noted = new Set(); // blob ids refused and logged once
    this.quiet = null; // the round whose "not invited" was logged
    this.declined = null; // the round whose "not eligible" was logged
    this.secureNoted = null; // the round whose secure session was declined in the log
    this.steps = {
      [S.ANNOUNCE]: () => this.announce(), [S.CHECK]: () => this.check(), [S.DECIDE]: () => this.step(this.situation()),
      [S.FETCH]: () => (this.roundModel() ? this.step(E.MODEL) : []), [S.TRAIN]: () => this.train(),
      [S.SEND]: () => this.send(), [S.SEND_AGAIN]: () => this.sendAgain(), [S.SEND_STALE]: () => this.sendStale(),
      [S.EVALUATE]: () => [{ job: 'evaluate', info: this.round, model: this.model.tensors }],
    };
  }

  get done() { return this.phase === P.DONE; }

  /** One event at `now` (unix seconds): what to publish and which jobs to run. AgentError when it cannot go on. */
  handle(event, now) {
    this.now = now;
    switch (event.type) {
      case 'message': return this.onMessage(event.topic, event.payload);
      case 'tick': {
        const due = !this.eligible && (this.recheckAt === null || now >= this.recheckAt);
        return due ? this.step(E.RECHECK) : [];
      }
      case 'connected':
        this.log('connected');
        this.recheckAt = null; // a connect is a reason to look at the conditions again
        return this.step(E.CONNECTED);
      case 'checked': return this.onChecked(event.job, event.problem);
      case 'trained': {
        this.saved = event.saved;
        const info = this.round;
        const movedOn = !info || info.state !== 'open' || info.round !== event.job.info.round;
        return this.step(movedOn ? E.TRAINED_LATE : E.TRAINED);
      }
      case 'evaluated':
        this.finalAccuracy = event.accuracy;
        return this.step(E.EVALUATED);
      default: throw new TypeError(`not an engine input: ${JSON.stringify(event)}`);
    }
  }

  /** The table's row for (phase, event): move to its phase, run its steps. */
  step(event) {
    const [next, steps] = TRANSITIONS.get(`${this.phase}|${event}`) ?? [this.phase, []];
    this.phase = next;
    return steps.flatMap((s) => this.steps[s]());
  }

  /** What the open round asks of this device now (the conditions are checked once per round). The page runs no
   * secure aggregation: a secure round asks nothing of it (fedper-agent without the privacy extra trains, then
   * declines to send). */
  situation() {
    const info = this.round;
    if (!info || (info.state === 'open' && !this.invitedTo(info))) return E.NOT_ASKED;
    if (info.state === 'finished') return E.FINISHED;
    if (info.secagg_session !== null) {
      if (this.secureNoted !== info.round) {
        this.secureNoted = info.round;
        this.log(`round ${info.round}: the coordinator runs secure aggregation, which the web agent does not do: not taking part`);
      }
      return E.NOT_ASKED;
    }
    if (this.settings.conditions && this.accepted !== info.round) {
      const backingOff = this.recheckAt !== null && this.now < this.recheckAt;
      return backingOff ? E.INELIGIBLE : E.UNCHECKED;
    }
    return this.saved && this.saved.round === info.round ? E.ROUND_ANSWERED : E.ROUND_OPEN;
  }

  /** What to be subscribed to now: RoundInfo, errors and invitations always; the model's chunks once RoundInfo
   * says which (with selection: only while this device waits for the model). */
  subscriptions() {
    const t = this.topics, me = this.settings.clientId, info = this.round;
    const wanted = [t.round, t.error(me), t.invite(me)];
    if (info && info.selection === 'all') wanted.push(t.allModels);
    else if (info && FETCHING.includes(this.phase) && !this.holdsModel(info)) wanted.push(t.modelsOf(info.blob_id));
    return wanted;
  }

  // ------------------------------------------------------------ messages in

  onMessage(topic, payload) {
    const t = this.topics, me = this.settings.clientId;
    try {
      if (topic === t.round) return this.onRoundInfo(decodeMessage('RoundInfo', payload));
      if (topic.startsWith(`${t.base}/model/`)) return this.onModelChunk(topic, payload);
      if (topic === t.error(me)) return this.onError(decodeMessage('ErrorMessage', payload));
      if (topic === t.invite(me)) return this.onInvitation(payload);
    } catch (e) {
      if (!(e instanceof WireError)) throw e;
      this.log(`ignored a bad message on ${topic}: ${e.message}`);
    }
    return [];
  }

  onRoundInfo(info) {
    const problem = this.roundInfoProblem(info);
    if (problem) {
      this.log(`ignored RoundInfo of round ${info.round} (${info.state}): ${problem}`);
      return [];
    }
    const again = this.round === null || this.round.round === info.round; // (re)published, or the first seen
    this.round = info;
    this.recheckAt = null; // a RoundInfo is a reason to look at the conditions again
    if (info.state === 'open' && !this.invitedTo(info) && this.quiet !== info.round) {
      this.quiet = info.round;
      const wait = (info.next_selection_at ?? info.deadline) - this.now;
      this.log(`round ${info.round}: not invited; quiet until an invitation or the next selection (due within ${Math.max(wait, 0).toFixed(0)} s)`);
    }
    // v1 acknowledges no update: the saved one goes again whenever its round's RoundInfo is (re)published, and so
    // does one of an earlier round that asynchronous rounds still take
    const stale = again && this.lostStale(info) ? this.step(E.RESEND_STALE) : [];
    return [...stale, ...this.step(this.situation())];
  }

  /** Whether the saved update is of an earlier round that `info` (asynchronous: max_staleness) still takes and can
   * be encoded again (a delta codec needs the model it was trained on, kept in memory only). */
  lostStale(info) {
    const saved = this.saved;
    if (info.state !== 'open' || info.max_staleness === null || !saved) return false;
    if (!(info.round - info.max_staleness <= saved.round && saved.round < info.round)) return false;
    return this.kept?.info.round === saved.round || !DELTA_CODECS.includes(this.settings.codec);
  }

  roundInfoProblem(info) {
    if (info.base_digest !== this.manifest.baseDigest) return `it is for another export (base_digest ${info.base_digest}, ours ${this.manifest.baseDigest})`;
    if (info.round > info.rounds) return `round ${info.round} of a run of ${info.rounds} rounds`;
    if (info.size > this.models.maxBlobSize) return `its model declares ${info.size} bytes, more than this model's shared tensors take (${this.models.maxBlobSize})`;
    const answered = Math.max(this.saved?.round ?? 0, this.training?.info.round ?? 0);
    if (info.state === 'open' && info.round < answered) return `stale: this device already answered round ${answered}`;
    if (info.lr != null && !(info.lr > 0)) return `its learning rate ${info.lr} is not > 0`;
    return null;
  }

  onInvitation(payload) {
    const info = this.round;
    if (!payload.length) { // cleared: its round closed
      this.invited = null;
      const withdrawn = info !== null && info.state === 'open' && !this.invitedTo(info);
      return withdrawn ? this.step(E.UNINVITED) : [];
    }
    const invitation = decodeMessage('Invitation', payload);
    this.invited = invitation.round;
    if (info && info.round === invitation.round) {
      this.log(`round ${info.round}: invited`);
      this.recheckAt = null;
      return this.step(E.INVITED);
    }
    return []; // for another round: acted on once RoundInfo opens it
  }

  invitedTo(info) { return info.selection === 'all' || this.invited === info.round; }

  onModelChunk(topic, payload) {
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
    this.blob = blob; // only the newest model is worth keeping
    return this.step(E.BLOB);
  }

  refuseBlob(blobId, line) {
    if (this.noted.has(blobId)) return;
    if (this.noted.size >= MAX_NOTED_BLOBS) this.noted.clear();
    this.noted.add(blobId);
    this.log(line);
  }

  onError(error) {
    this.log(`coordinator: ${error.code}: ${error.message}`);
    if (error.code === 'digest_mismatch') throw new AgentError(`the coordinator refused this export: ${error.message}`);
    if ((error.code === 'unknown_device' || error.code === 'bad_chunk') && this.saved && error.round === this.saved.round) {
      return this.step(E.RESEND); // register again, then send the update again (a fresh blob id)
    }
    return [];
  }

  /** Record a verdict on the conditions: log why not once per round, publish presence if it changed. */
  onChecked(job, problem) {
    const was = this.eligible, where = job.round ? `round ${job.round}: ` : '', info = this.round;
    this.eligible = problem === null;
    if (this.eligible) {
      this.recheckAt = null;
      if (this.declined !== null) {
        this.log(`${where}eligible again`);
        this.declined = null;
      }
      if (info && info.round === job.round && info.state === 'open' && this.invitedTo(info)) this.accepted = job.round;
    } else {
      this.recheckAt = this.now + this.settings.recheckS;
      if (this.declined !== job.round) {
        this.declined = job.round;
        this.log(`${where}not eligible (${problem}): not taking part; checking again in ${this.settings.recheckS} s`);
      }
    }
    const presence = this.eligible !== was ? [this.presence()] : [];
    return [...presence, ...this.step(E.CHECKED)];
  }

  // ------------------------------------------------------------ steps

  /** Presence and Register, on every connect; the retained RoundInfo then resends an unacknowledged update. */
  announce() {
    const t = this.topics, me = this.settings.clientId;
    const register = encodeMessage('Register', { n_samples: this.settings.nSamples, base_digest: this.manifest.baseDigest, software: SOFTWARE });
    return [this.presence(), { topic: t.register(me), payload: register, retain: true }];
  }

  /** `online` while the device is willing to train (a selecting coordinator invites only those). */
  presence() {
    return { topic: this.topics.presence(this.settings.clientId), payload: utf8(this.eligible ? 'online' : 'offline'), retain: true };
  }

  check() {
    const job = { job: 'check', round: this.round ? this.round.round : 0 };
    return this.settings.conditions ? [job] : this.onChecked(job, null);
  }

  /** The model RoundInfo names, decoded once and checked; null while it is not here (or refused). */
  roundModel() {
    const info = this.round;
    if (this.holdsModel(info)) return this.model.tensors;
    const blob = this.blob;
    if (!blob || blob.blobId !== info.blob_id) return null;
    if (blob.sha256 !== info.sha256) { // kept: the RoundInfo may be the forged one
      this.log(`model ${info.blob_id} does not match the round's sha256: waiting for the right one`);
      return null;
    }
    this.blob = null;
    this.model = null; // the last round's model is done with: never hold two decoded models
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

  holdsModel(info) {
    return this.model !== null && this.model.blobId === info.blob_id && this.model.sha256 === info.sha256;
  }

  train() {
    this.training = { job: 'train', info: this.round, model: this.model.tensors };
    return [this.training];
  }

  /** Send the update just trained, also when the round moved on meanwhile (the coordinator answers late_update),
   * unless the open asynchronous round no longer takes its version (max_staleness): the stale-update check. */
  send() {
    const job = this.training, info = this.round;
    this.training = null;
    if (info && info.state === 'open' && info.max_staleness !== null && job.info.round < info.round - info.max_staleness) {
      this.log(`round ${job.info.round}: trained, but round ${info.round} is open and takes updates of rounds ${info.round - info.max_staleness} on: not sent`);
      return [];
    }
    this.kept = job.info.max_staleness !== null ? job : null; // a resend may need its model
    return this.update(job.model);
  }

  sendAgain() {
    this.log(`round ${this.round.round}: already trained (before a reload, a reconnect or the round's re-publication), sending the saved update again`);
    return this.update(this.model.tensors);
  }

  sendStale() {
    const saved = this.saved, kept = this.kept;
    this.log(`round ${this.round.round}: sending the saved update of round ${saved.round} again (asynchronous rounds still take it; it may have been lost)`);
    return this.update(kept?.info.round === saved.round ? kept.model : null);
  }

  /** The chunk frames of the saved update (a delta codec encodes the difference from the round's `model`). */
  update(model) {
    const saved = this.saved, s = this.settings;
    const meta = { round: saved.round, n_samples: saved.nSamples, base_digest: saved.baseDigest, metrics: saved.metrics, codec: s.codec };
    const hex = [...this.random(4)].map((b) => b.toString(16).padStart(2, '0')).join('');
    const reference = DELTA_CODECS.includes(s.codec) ? model : null;
    const blob = encodeShared(this.manifest, new Map(Object.entries(saved.update)), s.codec, reference);
    const frames = chunkBlob(blob, s.chunkSize, `r${saved.round}-${hex}`, messageFields('UpdateMeta', meta));
    return frames.map((payload) => ({ topic: this.topics.update(s.clientId), payload, retain: false }));
  }
}

/** A device: the engine, and its jobs run in order as they come (edge/agent.py's settle), each job's result fed back
 * before the next message. config: {fleet, clientId, ...DEFAULTS}; data: {xTrain, yTrain, xTest, yTest}; trainer: a
 * Trainer; store: IndexedDBStore or MemoryStore; log(line); random(n bytes) -> Uint8Array; conditions: null (always
 * willing to train) or async () -> null when the device may train now, else why not (fedper-agent's --only-when). */
export class Agent {
  constructor({ config, manifest, trainer, data, store, log = console.log, random, conditions = null, clock = () => Date.now() / 1000 }) {
    this.config = { ...DEFAULTS, ...config };
    this.manifest = manifest;
    this.trainer = trainer;
    this.data = data;
    this.store = store;
    this.log = log;
    this.conditions = conditions;
    this.clock = clock;
    this.phases = this.config.fineTuneHead && manifest.phases[0][0] !== 'head' ? [['head', 1], ...manifest.phases] : manifest.phases;
    this.serveTuned = manifest.fineTuneHeadAtEval && this.config.evalFinetuneEpochs > 0;
    const needed = new Set([...this.phases.map(([trained]) => trained), ...(this.serveTuned ? [this.config.evalFinetune] : [])]);
    const missing = [...needed].filter((k) => !(k in manifest.artifactSets));
    if (missing.length) throw new AgentError(`the algorithm's phases train ${missing} but the export has no such artifact set`);
    const c = this.config;
    this.engine = new AgentEngine({
      manifest, log, random,
      settings: { clientId: c.clientId, fleet: c.fleet, nSamples: this.nSamples, chunkSize: c.chunkSize, codec: c.codec, conditions: conditions !== null },
    });
    this.topics = this.engine.topics;
    this.lastSent = 0; // the newest round this page (since its load) sent an update for; never reset, for observers
  }

  get nSamples() { return this.data.yTrain.length; }
  get saved() { return this.engine.saved; }
  get round() { return this.engine.round; }
  get finalAccuracy() { return this.engine.finalAccuracy; }

  /** Restore the head of the last completed round from the store; call once before connecting. */
  async restore() {
    const saved = await this.store.get('device');
    if (!saved) return;
    if (saved.baseDigest !== this.manifest.baseDigest) {
      this.log(`the stored state belongs to another export (${saved.baseDigest}): starting afresh`);
      return;
    }
    this.engine.saved = saved;
    this.trainer.load(new Map(Object.entries(saved.local)));
    this.log(`restored the head of round ${saved.round} from this browser's storage`);
  }

  /** What to be subscribed to now (the engine's). */
  subscriptions() { return this.engine.subscriptions(); }

  /** Presence and Register, on every connect (and the conditions' check they lead to): the messages to publish. */
  async connected() { return this.settle(this.engine.handle({ type: 'connected' }, this.clock())); }

  /** Time passed: checks the conditions again once their back-off is over. */
  async tick() { return this.settle(this.engine.handle({ type: 'tick' }, this.clock())); }

  /** One message from the broker; the messages to publish in answer. AgentError when the agent cannot go on. */
  async handle(topic, payload) { return this.settle(this.engine.handle({ type: 'message', topic, payload }, this.clock())); }

  /** Run the jobs among `actions` (and those their results lead to) in order: what to publish. */
  async settle(actions) {
    const out = [], pending = [...actions], updates = this.topics.update(this.config.clientId);
    while (pending.length) {
      const action = pending.shift();
      if (action.job === undefined) out.push(action);
      else pending.push(...this.engine.handle(await this.run(action), this.clock()));
    }
    if (out.some((m) => m.topic === updates)) this.lastSent = Math.max(this.lastSent, this.saved.round);
    return out;
  }

  /** Do what the engine asked; the event to feed it back. */
  async run(job) {
    if (job.job === 'check') return { type: 'checked', job, problem: await this.conditions() };
    if (job.job === 'train') {
      this.trainer.load(job.model);
      const training = roundTraining(job.info, this.config);
      if (SENT.some(([field]) => job.info[field] != null)) {
        this.log(`round ${job.info.round}: training as the coordinator says: lr ${training.lr}, ${training.localEpochs} local epoch(s), batch ${training.batchSize}`);
      }
      return { type: 'trained', job, saved: await this.trainRound(job.info.round, training) };
    }
    return { type: 'evaluated', job, accuracy: await this.finish(job.info, job.model) };
  }

  /** Evaluate the final model as the device serves it, keep it in the store: its accuracy. */
  async finish(info, model) {
    this.trainer.load(model);
    await this.tuneForServing(info.rounds + 1); // the emulator's evaluation after round R keys it R + 1
    const { accuracy, loss } = await this.trainer.evaluate(this.data.xTest, this.data.yTest);
    this.log(`finished after ${info.rounds} rounds: personalized accuracy ${accuracy.toFixed(4)} (${chanceWords(this.data.yTest)})`);
    const served = Object.fromEntries(this.trainer.read(this.manifest.names()));
    await this.store.put('final', { rounds: info.rounds, accuracy, loss, served });
    return accuracy;
  }

  /** FedBABU: fine-tune the loaded model in place, as the device serves it (with the last round's settings);
   * returns the untuned tensors. */
  async tuneForServing(round) {
    if (!this.serveTuned) return null;
    const c = this.config, d = this.data, t = this.lastTraining ?? c;
    const untuned = this.trainer.read(this.manifest.names());
    await this.trainer.train(c.evalFinetune, d.xTrain, d.yTrain, {
      epochs: c.evalFinetuneEpochs, batchSize: t.batchSize, lr: t.lr, seed: [c.seed, round, PURPOSE_FINETUNE],
    });
    return untuned;
  }

  /** Evaluate the served model, train every phase with `training` (roundTraining; default: the page's own
   * settings), save the state; the base is already loaded. */
  async trainRound(round, training = this.config) {
    const c = this.config, d = this.data, t = this.lastTraining = training;
    const untuned = d.yTest.length ? await this.tuneForServing(round) : null;
    const { accuracy, loss: testLoss } = await this.trainer.evaluate(d.xTest, d.yTest);
    if (untuned) this.trainer.load(untuned);
    let samples = 0, seconds = 0, trainLoss = NaN;
    for (const [index, [trained, epochs]] of this.phases.entries()) {
      const stats = await this.trainer.train(trained, d.xTrain, d.yTrain, {
        epochs: epochs ?? t.localEpochs, batchSize: t.batchSize, lr: t.lr, seed: [c.seed, round, index],
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
    this.log(`round ${round}: served accuracy ${accuracy.toFixed(4)} (${chanceWords(d.yTest)}; test loss ${testLoss.toFixed(4)}); trained ${samples} samples in ${seconds.toFixed(1)} s (${(samples / Math.max(seconds, 1e-9)).toFixed(0)} samples/s), train loss ${trainLoss.toFixed(4)}`);
    return saved;
  }
}
