// The page's wire against the protocol's test vectors (tests/vectors/, docs/protocol.md section 9): it decodes
// every valid vector to its content, refuses every bad-* one with its code, and writes the same bytes for the same
// message, blob, blob id and chunk size. Then frames written by hand that the page must refuse.

import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'node:test';

import { decodeModel, encodeShared } from '../src/agent.js';
import { crc32 } from '../src/hash.js';
import { Manifest } from '../src/manifest.js';
import { Reassembler, Topics, WireError, chunkBlob, decodeChunk, decodeMessage, encodeMessage } from '../src/wire.js';
import { VECTORS } from './helpers.mjs';

const bytes = (name) => new Uint8Array(readFileSync(join(VECTORS, `${name}.bin`)));
const expected = (name) => JSON.parse(readFileSync(join(VECTORS, `${name}.expected.json`)));
const manifest = new Manifest(JSON.parse(readFileSync(join(VECTORS, 'manifest.json'))));
const plain = (v) => JSON.parse(JSON.stringify(v, (k, x) => (x?.constructor?.name === 'JsonFloat' ? x.value : x)));

test('JSON messages decode to the vectors\' content and encode to their bytes', () => {
  for (const name of ['register', 'round', 'error']) {
    const e = expected(name);
    const decoded = decodeMessage(e.kind === 'ErrorMessage' ? 'ErrorMessage' : e.kind, bytes(name));
    const { v, ...fields } = e.message;
    assert.equal(v, 1);
    for (const [key, value] of Object.entries(fields)) assert.deepEqual(decoded[key], value, `${name}.${key}`);
  }
  const register = expected('register').message;
  assert.deepEqual(encodeMessage('Register', register), bytes('register'));
  assert.equal(new Topics('demo').register('phone-1'), expected('register').topic);
});

test('chunk frames decode to their headers and data, and the blobs reassemble to their tensors', () => {
  for (const name of ['model-r1', 'update-r1']) {
    const blob = expected(name);
    const parts = new Reassembler(manifest.maxBlobSize);
    let whole = null;
    for (const [i, file] of blob.chunks.entries()) {
      const e = expected(file.replace('.bin', ''));
      const chunk = decodeChunk(bytes(file.replace('.bin', '')));
      assert.equal(Buffer.from(chunk.data).toString('hex'), e.data_hex);
      assert.deepEqual({ v: 1, blob_id: chunk.blobId, index: chunk.index, count: chunk.count, size: chunk.size, chunk_size: chunk.chunkSize, sha256: chunk.sha256, meta: plain(chunk.meta) }, e.header);
      whole = parts.add(chunk);
      assert.equal(whole === null, i < blob.chunks.length - 1);
    }
    assert.deepEqual(whole.data, bytes(name));
    const tensors = decodeModel(manifest, whole.data);
    for (const [tensor, want] of Object.entries(blob.tensors)) assert.deepEqual([...tensors.get(tensor)], want.values);
  }
  const empty = decodeChunk(bytes('empty-blob.0'));
  assert.equal(empty.size, 0);
  assert.equal(new Reassembler(100).add(empty).data.length, 0);
});

test('the page writes an update byte for byte as the Python agent does', () => {
  const e = expected('update-r1');
  const tensors = new Map(Object.entries(e.tensors).map(([n, t]) => [n, Float32Array.from(t.values)]));
  const blob = encodeShared(manifest, tensors);
  assert.deepEqual(blob, bytes('update-r1'));
  const meta = expected('update-r1.0').header.meta;
  const frames = chunkBlob(blob, 64, 'r1-0a1b2c3d', meta);
  frames.forEach((frame, i) => assert.deepEqual(frame, bytes(`update-r1.${i}`)));
});

test('a head tensor cannot be encoded: only the manifest\'s shared tensors leave the page', () => {
  const e = expected('update-r1');
  const tensors = new Map(Object.entries(e.tensors).map(([n, t]) => [n, Float32Array.from(t.values)]));
  tensors.set('classifier.weight', new Float32Array(6));
  assert.throws(() => encodeShared(manifest, tensors), /not shared: classifier.weight/);
});

test('bad vectors are refused with their codes', () => {
  for (const name of ['bad-corrupt-chunk', 'bad-truncated-chunk', 'bad-short-frame']) {
    assert.throws(() => decodeChunk(bytes(name)), (e) => e instanceof WireError && e.code === expected(name).error, name);
  }
  assert.throws(() => decodeMessage('Register', bytes('bad-version')), (e) => e.code === 'bad_message');
});

const utf8 = (text) => new TextEncoder().encode(text);

/** A frame put together by hand: u32 header length, u32 CRC-32, header, data (docs/protocol.md section 5). */
function handFrame(headerText, data = new Uint8Array(0)) {
  const head = utf8(headerText);
  const out = new Uint8Array(8 + head.length + data.length);
  const view = new DataView(out.buffer);
  view.setUint32(0, head.length);
  const body = new Uint8Array(head.length + data.length);
  body.set(head);
  body.set(data, head.length);
  view.setUint32(4, crc32(body));
  out.set(body, 8);
  return out;
}

test('messages out of their bounds are refused, as fedper.wire refuses them', () => {
  const digest = '"base_digest":"sha256:x"';
  const round = (extra) => utf8(`{"v":1,"round":1,"rounds":3,"state":"open","deadline":1.5,"blob_id":"r1","size":10,"sha256":"${'a'.repeat(64)}","count":1,${digest}${extra}}`);
  assert.equal(decodeMessage('RoundInfo', round('')).round, 1);
  const refused = [
    utf8('{"v":1.0,"round":1}'), // v is the integer 1
    utf8('{"v":true,"round":1}'),
    utf8('{"v":1,"round":1.0}'), // an integer field takes no float
    utf8('{"v":1,"round":9223372036854775808}'), // beyond 2^53 - 1: refused, never rounded
    utf8(`{"v":1,"round":1${'0'.repeat(400)}}`),
    utf8('{"v":1,"round":0}'), // at least 1
    utf8('{"v":1,"round":-1}'),
    utf8('{"v":1,"round":NaN}'),
    utf8('[1]'),
    new Uint8Array([0x7b, 0xff, 0x7d]), // not UTF-8
  ];
  for (const payload of refused) assert.throws(() => decodeMessage('Invitation', payload), (e) => e.code === 'bad_message', new TextDecoder().decode(payload).slice(0, 40));
  assert.throws(() => decodeMessage('RoundInfo', round(',"selection":"some"')), /selection/);
  assert.throws(() => decodeMessage('RoundInfo', utf8(`{"v":1,"round":1,"rounds":3,"state":"open","deadline":1e400,"blob_id":"r1","size":10,"sha256":"${'a'.repeat(64)}","count":1,${digest}}`)), /out of range/);
  assert.throws(() => decodeMessage('RoundInfo', round(',"next_selection_at":"soon"')), /next_selection_at/);
  assert.equal(decodeMessage('RoundInfo', round(',"unknown":[1,{"a":2}]')).selection, 'all'); // unknown fields ignored
  assert.throws(() => decodeMessage('ErrorMessage', utf8(`{"v":1,"code":"x","message":"${'m'.repeat(4097)}"}`)), /at most 4096/);
});

test('chunks whose fields do not add up are refused', () => {
  const sha = 'b'.repeat(64);
  const header = (fields) => `{"v":1,"blob_id":"r1","index":0,"count":1,"size":3,"chunk_size":8,"sha256":"${sha}","meta":{}${fields}}`;
  assert.equal(decodeChunk(handFrame(header(''), new Uint8Array(3))).size, 3);
  const cases = [
    [header(''), new Uint8Array(2)], // data shorter than the chunk
    [header('').replace('"count":1', '"count":2'), new Uint8Array(3)], // count is not ceil(size / chunk_size)
    [header('').replace('"index":0', '"index":1'), new Uint8Array(3)],
    [header('').replace('"chunk_size":8', '"chunk_size":0'), new Uint8Array(3)],
    [header('').replace('"blob_id":"r1"', '"blob_id":"../x"'), new Uint8Array(3)],
    [header('').replace(`"sha256":"${sha}"`, '"sha256":"B"'), new Uint8Array(3)],
    [header('').replace('"meta":{}', '"meta":[]'), new Uint8Array(3)],
    [header('').replace('"size":3', '"size":3.0'), new Uint8Array(3)],
  ];
  for (const [text, data] of cases) assert.throws(() => decodeChunk(handFrame(text, data)), (e) => e.code === 'bad_chunk', text);
  assert.throws(() => decodeChunk(handFrame(header('').replace('"size":3', '"size":9000'), new Uint8Array(8)), 100), /oversized/);
  const big = new Uint8Array(8);
  new DataView(big.buffer).setUint32(0, 20000);
  assert.throws(() => decodeChunk(big), /exceeds 16384/);
});

test('a blob whose chunks disagree or whose bytes are not its sha256 is refused', () => {
  const parts = new Reassembler(1000);
  const frames = chunkBlob(utf8('hello world'), 4, 'b1', { round: 1 });
  parts.add(decodeChunk(frames[0]));
  const other = chunkBlob(utf8('hello there'), 4, 'b1', { round: 1 });
  assert.throws(() => parts.add(decodeChunk(other[1])), /differs/);
  const wrong = handFrame(`{"v":1,"blob_id":"b2","index":0,"count":1,"size":2,"chunk_size":4,"sha256":"${'0'.repeat(64)}","meta":{}}`, utf8('hi'));
  assert.throws(() => parts.add(decodeChunk(wrong)), /sha256 mismatch/);
});
