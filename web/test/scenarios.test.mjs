// One contract for both agents: every scenario vector (tests/vectors/scenarios/, recorded from edge/engine.py by
// tests/vectors/make_scenarios.py; the format is docs/protocol.md section 9.1) replayed against the page's engine
// (web/src/agent.js): after each event it must publish the same messages, ask for the same jobs, and end in the same
// phase with the same subscriptions as fedper-agent's engine did.

import assert from 'node:assert/strict';
import { readFileSync, readdirSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'node:test';

import { Agent, AgentEngine, AgentError, decodeModel } from '../src/agent.js';
import { Manifest } from '../src/manifest.js';
import { MemoryStore } from '../src/store.js';
import { Reassembler, decodeChunk } from '../src/wire.js';
import { VECTORS } from './helpers.mjs';

const DIR = join(VECTORS, 'scenarios');
const manifest = new Manifest(JSON.parse(readFileSync(join(VECTORS, 'manifest.json'))));
const utf8 = (text) => new TextEncoder().encode(text);
const hexBytes = (hex) => Uint8Array.from(hex.match(/../g) ?? [], (h) => parseInt(h, 16));
const tensors = (update) => Object.fromEntries(Object.entries(update).map(([n, v]) => [n, Float32Array.from(v)]));
const plain = (v) => JSON.parse(JSON.stringify(v, (k, x) => (x?.constructor?.name === 'JsonFloat' ? x.value : x)));

/** A saved round in the page's form (the store's `device` record). */
function saved(round, nSamples, metrics, update) {
  return { round, baseDigest: manifest.baseDigest, nSamples, metrics, local: {}, update: tensors(update) };
}

/** The engine's actions in the scenario's terms (make_scenarios.normalize): an update's frames as one entry,
 * Register's software as "*". */
/** The round's training settings a job's RoundInfo carries (make_scenarios.py TRAINING_FIELDS), if any. */
function training(info) {
  const sent = Object.fromEntries(['lr', 'local_epochs', 'batch_size'].filter((f) => info[f] != null).map((f) => [f, info[f]]));
  return Object.keys(sent).length ? { training: sent } : {};
}

function normalize(out, updateTopic, registerTopic) {
  const entries = [];
  let frames = [];
  out.forEach((action, i) => {
    if (action.job !== undefined) {
      entries.push(action.job === 'check' ? { job: 'check', round: action.round }
        : { job: action.job, round: action.info.round, blob_id: action.info.blob_id, ...training(action.info) });
    } else if (action.topic === updateTopic) {
      frames.push(action.payload);
      assert.equal(action.retain, false);
      if (out[i + 1]?.topic !== updateTopic) {
        entries.push(updateEntry(frames, updateTopic));
        frames = [];
      }
    } else {
      const text = new TextDecoder().decode(action.payload);
      const shown = text.startsWith('{') ? { message: JSON.parse(text) } : { text };
      if (action.topic === registerTopic) shown.message.software = '*'; // each agent names itself
      entries.push({ publish: action.topic, retain: action.retain, ...shown });
    }
  });
  return entries;
}

function updateEntry(frames, topic) {
  const parts = new Reassembler(1 << 20);
  const blobs = frames.map((f) => parts.add(decodeChunk(f))).filter((b) => b !== null);
  assert.equal(blobs.length, 1, 'an update\'s frames make one blob');
  const meta = plain(decodeChunk(frames[0]).meta);
  assert.match(blobs[0].blobId, new RegExp(`^r${meta.round}-[0-9a-f]{8}$`));
  const decoded = Object.fromEntries([...decodeModel(manifest, blobs[0].data)].map(([n, x]) => [n, [...x]]));
  return { publish: topic, retain: false, update: { blob_id: `r${meta.round}-*`, meta, tensors: decoded } };
}

function replay(scenario) {
  const s = scenario.settings;
  const start = scenario.saved && saved(scenario.saved.round, scenario.saved.n_samples, scenario.saved.metrics, scenario.saved.update);
  const engine = new AgentEngine({
    manifest, saved: start, log: () => {}, random: () => new Uint8Array([0xde, 0xad, 0xbe, 0xef]),
    settings: { clientId: s.client_id, fleet: s.fleet, nSamples: s.n_samples, chunkSize: s.chunk_size, codec: s.compression, conditions: s.conditions, recheckS: s.recheck_s },
  });
  const updateTopic = engine.topics.update(s.client_id);
  const jobs = [];
  const newest = (kind) => jobs.findLast((j) => j.job === kind);
  for (const [i, step] of scenario.steps.entries()) {
    const e = step.event, where = `step ${i} (${e.type}${e.topic ? ` on ${e.topic}` : ''})`;
    const event = {
      connected: () => ({ type: 'connected' }),
      tick: () => ({ type: 'tick' }),
      message: () => ({ type: 'message', topic: e.topic, payload: 'text' in e ? utf8(e.text) : hexBytes(e.hex) }),
      checked: () => ({ type: 'checked', job: newest('check'), problem: e.problem }),
      trained: () => {
        const job = newest('train');
        return { type: 'trained', job, saved: saved(job.info.round, s.n_samples, e.metrics, e.update) };
      },
      evaluated: () => ({ type: 'evaluated', job: newest('evaluate'), accuracy: e.accuracy }),
    }[e.type]();
    if (step.raises) {
      assert.throws(() => engine.handle(event, step.at), AgentError, where);
    } else {
      const out = engine.handle(event, step.at);
      jobs.push(...out.filter((a) => a.job !== undefined));
      assert.deepEqual(normalize(out, updateTopic, engine.topics.register(s.client_id)), step.out, where);
    }
    assert.equal(engine.phase, step.phase, `${where}: phase`);
    assert.deepEqual(engine.subscriptions(), step.subscriptions, `${where}: subscriptions`);
  }
}

const files = readdirSync(DIR).filter((f) => f.endsWith('.json')).sort();

test('the scenario vectors are there', () => {
  assert.ok(files.length >= 12, files.join(', '));
});

for (const file of files) {
  const scenario = JSON.parse(readFileSync(join(DIR, file)));
  test(`scenario ${file.replace('.json', '')}: ${scenario.about}`, () => replay(scenario));
}

/** What a scenario publishes, in order, as text: the Agent's runner answers jobs at once, so only a scenario
 * whose events never come while a job is out publishes in the same order through it. */
function publications(entries) {
  return entries.filter((o) => o.publish).map((o) => (o.update
    ? `update r${o.update.meta.round} ${JSON.stringify(o.update.tensors)}`
    : `${o.publish} ${o.text ?? JSON.stringify(o.message)}`));
}

function sequential(scenario) {
  let out = 0;
  for (const step of scenario.steps) {
    if (['checked', 'trained', 'evaluated'].includes(step.event.type)) out -= 1;
    else if (out > 0) return false;
    out += (step.out ?? []).filter((o) => o.job).length;
  }
  return true;
}

const runnable = files.map((f) => [f, JSON.parse(readFileSync(join(DIR, f)))]).filter(([, s]) => sequential(s));

test('the Agent runs the engine\'s jobs as the scenarios answer them and publishes what they say', async () => {
  assert.ok(runnable.length >= 6, runnable.map(([f]) => f).join(', '));
  const withArtifacts = new Manifest({ ...JSON.parse(readFileSync(join(VECTORS, 'manifest.json'))), artifact_sets: { all: 'train/all' } });
  for (const [file, scenario] of runnable) {
    const s = scenario.settings, results = scenario.steps.map((step) => step.event);
    const next = (type) => {
      const i = results.findIndex((e) => e.type === type);
      assert.ok(i >= 0, `${file}: a ${type} result the scenario does not give`);
      return results.splice(i, 1)[0];
    };
    const store = new MemoryStore();
    if (scenario.saved) {
      const { round, n_samples: nSamples, metrics, update } = scenario.saved;
      await store.put('device', saved(round, nSamples, metrics, update));
    }
    let clock = 0;
    const trainer = {
      load() {},
      async evaluate() { return { accuracy: 0.75, loss: 0.5 }; },
      async train() { return { samples: 0, seconds: 0, loss: 0.25 }; },
      read(names) { // the trained update of the scenario's next result; zeros for the head
        const trained = names.includes(manifest.sharedTensors[0].name) ? tensors(next('trained').update) : {};
        return new Map(names.map((n) => [n, trained[n] ?? new Float32Array(manifest.spec(n).shape.reduce((a, b) => a * b, 1))]));
      },
    };
    const agent = new Agent({
      config: { fleet: s.fleet, clientId: s.client_id, chunkSize: s.chunk_size, codec: s.compression }, manifest: withArtifacts,
      trainer, store, data: { xTrain: [], yTrain: new Array(s.n_samples), xTest: [], yTest: [0] }, log: () => {},
      conditions: s.conditions ? async () => next('checked').problem : null, clock: () => clock,
    });
    await agent.restore();
    const got = [];
    const registerTopic = agent.topics.register(s.client_id), updateTopic = agent.topics.update(s.client_id);
    for (const step of scenario.steps) {
      clock = step.at;
      const e = step.event;
      const run = { connected: () => agent.connected(), tick: () => agent.tick(),
        message: () => agent.handle(e.topic, 'text' in e ? utf8(e.text) : hexBytes(e.hex)) }[e.type];
      if (!run) continue;
      if (step.raises) await assert.rejects(run(), AgentError, file);
      else got.push(...normalize(await run(), updateTopic, registerTopic));
    }
    const wanted = scenario.steps.flatMap((step) => step.out ?? []);
    assert.deepEqual(publications(got), publications(wanted), file);
  }
});
