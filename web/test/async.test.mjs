// Asynchronous rounds (docs/protocol.md 8.2) on the page: the async vectors decode as documented, and a RoundInfo
// that comes again resends the saved update of an earlier round that max_staleness still takes, tagged with its
// round; out of the window, without max_staleness, or with a delta codec and no model of that round, nothing goes.
// RoundInfo frames are written by hand; the saved update comes from the store as after a reload (the path trains
// nothing: the trainer given here only takes the head back, and fails the test if asked for more).

import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'node:test';

import { Agent } from '../src/agent.js';
import { Manifest } from '../src/manifest.js';
import { MemoryStore } from '../src/store.js';
import { Reassembler, Topics, decodeChunk, decodeMessage } from '../src/wire.js';
import { VECTORS } from './helpers.mjs';

const bytes = (name) => new Uint8Array(readFileSync(join(VECTORS, `${name}.bin`)));
const expected = (name) => JSON.parse(readFileSync(join(VECTORS, `${name}.expected.json`)));
const body = JSON.parse(readFileSync(join(VECTORS, 'manifest.json')));
const manifest = new Manifest({ ...body, artifact_sets: { all: 'train/all' } }); // the phase it would train
const topics = new Topics('lab');
const utf8 = (text) => new TextEncoder().encode(text);

test('the asynchronous vectors decode to their content', () => {
  const round = decodeMessage('RoundInfo', bytes('round-async'));
  assert.equal(round.max_staleness, 2);
  assert.equal(round.selection, 'invited');
  assert.equal(decodeMessage('RoundInfo', bytes('round')).max_staleness, null); // synchronous: absent
  assert.equal(decodeMessage('Invitation', bytes('invite')).round, expected('invite').message.round);
  assert.equal(decodeMessage('ErrorMessage', bytes('error-stale')).code, 'stale_update');
  const chunk = decodeChunk(bytes('update-stale.0'));
  assert.deepEqual(chunk.meta.round, expected('update-stale.0').header.meta.round);
  assert.throws(() => decodeMessage('RoundInfo', utf8(new TextDecoder().decode(bytes('round-async')).replace('"max_staleness":2', '"max_staleness":-1'))), /max_staleness/);
});

function roundInfo(round, fields = '') {
  return utf8(`{"v":1,"round":${round},"rounds":9,"state":"open","deadline":1.9e9,"blob_id":"r${round}","size":168,` +
    `"sha256":"${'a'.repeat(64)}","count":3,"base_digest":"${manifest.baseDigest}","selection":"invited",` +
    `"next_selection_at":1.9e9${fields}}`);
}

async function device(codec = 'fp32') {
  const store = new MemoryStore();
  const update = Object.fromEntries(Object.entries(expected('update-r1').tensors).map(([n, t]) => [n, Float32Array.from(t.values)]));
  await store.put('device', { round: 1, baseDigest: manifest.baseDigest, nSamples: 120, metrics: { accuracy: 0.5 },
    local: { 'classifier.weight': new Float32Array(6) }, update });
  const trainer = { load() {}, train() { assert.fail('nothing is trained on this path'); } };
  const lines = [];
  const agent = new Agent({ config: { fleet: 'lab', clientId: 'phone-1', codec }, manifest, trainer, store,
    data: { xTrain: [], yTrain: new Array(120), xTest: [], yTest: [] }, log: (l) => lines.push(l), random: () => new Uint8Array(4) });
  await agent.restore();
  return { agent, lines, update };
}

/** The update frames among `out`, reassembled: [meta, blob]. */
function sent(out) {
  const frames = out.filter((m) => m.topic === topics.update('phone-1'));
  if (!frames.length) return null;
  const parts = new Reassembler(manifest.maxBlobSize);
  let blob = null;
  for (const frame of frames) blob = parts.add(decodeChunk(frame.payload)) ?? blob;
  return [decodeChunk(frames[0].payload).meta, blob.data];
}

test('RoundInfo again resends the saved update of an earlier round within the window, tagged with its round', async () => {
  const { agent, lines } = await device();
  const first = sent(await agent.handle(topics.round, roundInfo(2, ',"max_staleness":2')));
  assert.ok(first, lines.join('\n'));
  assert.equal(first[0].round, 1);
  assert.deepEqual(first[1], bytes('update-r1')); // the same bytes as the Python agent's update of round 1
  const again = sent(await agent.handle(topics.round, roundInfo(2, ',"max_staleness":2,"extra":1')));
  assert.equal(again[0].round, 1);
  assert.ok(lines.some((l) => l.includes('sending the saved update of round 1 again')));
  assert.equal(sent(await agent.handle(topics.round, roundInfo(4, ',"max_staleness":2'))), null); // a new round
  assert.equal(sent(await agent.handle(topics.round, roundInfo(4, ',"max_staleness":2'))), null); // 1 is out of it
});

test('synchronous rounds, and a delta codec without the model of that round, resend nothing stale', async () => {
  const plain = await device();
  assert.equal(sent(await plain.agent.handle(topics.round, roundInfo(2))), null);
  const delta = await device('int8-delta');
  assert.equal(sent(await delta.agent.handle(topics.round, roundInfo(2, ',"max_staleness":3'))), null);
});
