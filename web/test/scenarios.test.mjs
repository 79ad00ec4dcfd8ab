// One contract for both agents: every scenario vector (tests/vectors/scenarios/, recorded from edge/engine.py by
// tests/vectors/make_scenarios.py; the format is docs/protocol.md section 9.1) replayed against the page's engine
// (web/src/agent.js): after each event it must publish the same messages, ask for the same jobs, and end in the same
// phase with the same subscriptions as fedper-agent's engine did.

import assert from 'node:assert/strict';
import { readFileSync, readdirSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'node:test';

import { AgentEngine, AgentError, decodeModel } from '../src/agent.js';
import { Manifest } from '../src/manifest.js';
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
function normalize(out, updateTopic, registerTopic) {
  const entries = [];
  let frames = [];
  out.forEach((action, i) => {
    if (action.job !== undefined) {
      entries.push(action.job === 'check' ? { job: 'check', round: action.round }
        : { job: action.job, round: action.info.round, blob_id: action.info.blob_id });
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
