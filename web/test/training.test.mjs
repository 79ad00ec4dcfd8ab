// The round's training settings (docs/protocol.md, RoundInfo): the coordinator's lr, local epochs and batch size
// replace the page's own settings where RoundInfo carries them (edge/agent.py LocalTraining.of_round does the same
// for the Python agent); a RoundInfo without them leaves the page's own; out-of-range values are refused by the
// schema. Frames are the wire vectors and hand-written variants of them.

import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'node:test';

import { roundTraining } from '../src/agent.js';
import { decodeMessage } from '../src/wire.js';
import { VECTORS } from './helpers.mjs';

const text = (name) => readFileSync(join(VECTORS, `${name}.bin`), 'utf8');
const utf8 = (s) => new TextEncoder().encode(s);
const own = { lr: 0.3, localEpochs: 1, batchSize: 4 };

test('a RoundInfo with settings replaces the page\'s own, one without leaves them', () => {
  const sent = decodeMessage('RoundInfo', utf8(text('round-training')));
  const expected = JSON.parse(readFileSync(join(VECTORS, 'round-training.expected.json'))).message;
  assert.deepEqual(roundTraining(sent, own),
    { lr: expected.lr, localEpochs: expected.local_epochs, batchSize: expected.batch_size });
  assert.deepEqual(roundTraining(decodeMessage('RoundInfo', utf8(text('round'))), own), own);
  const lrOnly = decodeMessage('RoundInfo', utf8(text('round-training').replace(/,"local_epochs":3,"batch_size":64/, '')));
  assert.deepEqual(roundTraining(lrOnly, own), { ...own, lr: expected.lr });
});

test('settings out of range are refused by the schema', () => {
  for (const [field, bad] of [['local_epochs', '0'], ['local_epochs', '1001'], ['batch_size', '0'], ['batch_size', '2.5'], ['lr', '"fast"']]) {
    const frame = text('round-training').replace(new RegExp(`"${field}":[^,}]+`), `"${field}":${bad}`);
    assert.throws(() => decodeMessage('RoundInfo', utf8(frame)), new RegExp(field), `${field}: ${bad}`);
  }
});
