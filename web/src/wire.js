// Protocol v1 on the page's side (docs/protocol.md): topics, the JSON messages a device reads and writes, chunk
// frames and the reassembly of the round's model. Every field a message brings is checked against its bounds
// before the agent acts on it, as fedper/wire/ checks them (the fields and bounds: schema.js, generated from
// fedper/wire/messages.py by web/make_schema.py); a refusal is a WireError with the protocol's code.

import { crc32, sha256Hex } from './hash.js';
import { LIMITS, SCHEMAS } from './schema.js';

export const VERSION = 1;
export const NAME_RE = new RegExp(LIMITS.NAME_PATTERN);
export const MAX_JSON_INT = LIMITS.MAX_JSON_INT;
export const DEFAULT_CHUNK_SIZE = 63 * 1024;
export const MAX_HEADER_SIZE = 16 * 1024;
export const MAX_CHUNK_SIZE = 1 << 20;
const { MAX_METRICS, MAX_METRIC_VALUE } = LIMITS;
const SHA256_RE = /^[0-9a-f]{64}$/;
const encoder = new TextEncoder();

export class WireError extends Error {
  constructor(code, message) {
    super(message);
    this.code = code;
  }
}

export function checkName(name, what) {
  if (typeof name !== 'string' || !NAME_RE.test(name)) throw new WireError('bad_message', `${what} ${JSON.stringify(name)} must match ${NAME_RE.source}`);
  return name;
}

/** Topic names of one fleet: fedper/v1/<fleet>/... */
export class Topics {
  constructor(fleet) {
    this.base = `fedper/v${VERSION}/${checkName(fleet, 'fleet')}`;
  }
  get round() { return `${this.base}/round`; }
  get allModels() { return `${this.base}/model/#`; }
  register(device) { return `${this.base}/register/${checkName(device, 'device')}`; }
  presence(device) { return `${this.base}/presence/${checkName(device, 'device')}`; }
  update(device) { return `${this.base}/update/${checkName(device, 'device')}`; }
  error(device) { return `${this.base}/error/${checkName(device, 'device')}`; }
  invite(device) { return `${this.base}/invite/${checkName(device, 'device')}`; }
  relay(device) { return `${this.base}/relay/${checkName(device, 'device')}`; }
  model(blobId, index) { return `${this.base}/model/${checkName(blobId, 'blob_id')}/${index}`; }
  modelsOf(blobId) { return `${this.base}/model/${checkName(blobId, 'blob_id')}/#`; }
}

// ------------------------------------------------------------------ strict JSON

/** A JSON number written with a fraction or an exponent: a float field takes it, an integer field does not
 * (JSON.parse turns `1.0` into 1; protocol v1 refuses `"v": 1.0`, as fedper.wire does). */
class JsonFloat {
  constructor(value) { this.value = value; }
}

/** JSON text -> values; integers beyond 2^53 - 1 come back as BigInt (refused by every int field), floats as
 * JsonFloat; NaN, Infinity and numbers beyond the double range are refused. */
export function parseJson(text) {
  let i = 0;
  const fail = (why) => { throw new WireError('bad_message', `not UTF-8 JSON: ${why} at character ${i}`); };
  const space = () => { while (' \t\n\r'.includes(text[i]) && i < text.length) i++; };
  const value = (depth) => {
    if (depth > 64) fail('nested too deeply');
    space();
    const c = text[i];
    if (c === '{') {
      i++;
      const out = {};
      space();
      if (text[i] === '}') { i++; return out; }
      for (;;) {
        space();
        if (text[i] !== '"') fail('expected a key');
        const key = string();
        space();
        if (text[i++] !== ':') fail('expected ":"');
        Object.defineProperty(out, key, { value: value(depth + 1), enumerable: true, writable: true, configurable: true });
        space();
        if (text[i] === ',') { i++; continue; }
        if (text[i++] === '}') return out;
        fail('expected "," or "}"');
      }
    }
    if (c === '[') {
      i++;
      const out = [];
      space();
      if (text[i] === ']') { i++; return out; }
      for (;;) {
        out.push(value(depth + 1));
        space();
        if (text[i] === ',') { i++; continue; }
        if (text[i++] === ']') return out;
        fail('expected "," or "]"');
      }
    }
    if (c === '"') return string();
    for (const [word, v] of [['true', true], ['false', false], ['null', null]]) {
      if (text.startsWith(word, i)) { i += word.length; return v; }
    }
    const m = /^-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/.exec(text.slice(i, i + 1100));
    if (!m) fail('unexpected character');
    i += m[0].length;
    if (!m[2] && !m[3]) {
      const n = Number(m[0]);
      return Number.isSafeInteger(n) ? n : BigInt(m[0]);
    }
    const f = Number(m[0]);
    if (!Number.isFinite(f)) fail(`number ${m[0].slice(0, 20)} is out of range`);
    return new JsonFloat(f);
  };
  const string = () => {
    const start = i;
    i++;
    while (i < text.length && text[i] !== '"') i += text[i] === '\\' ? 2 : 1;
    if (i >= text.length) fail('unterminated string');
    i++;
    try { return JSON.parse(text.slice(start, i)); } catch { return fail('bad string'); }
  };
  const out = value(0);
  space();
  if (i !== text.length) fail('extra data');
  return out;
}

const isInt = (v) => typeof v === 'number' && Number.isInteger(v);
const shown = (v) => {
  const t = v instanceof JsonFloat ? String(v.value) : typeof v === 'bigint' ? `an integer of ${v.toString(2).length} bits` : JSON.stringify(v) ?? String(v);
  return t.length <= 80 ? t : `${t.slice(0, 77)}...`;
};

/** A JSON object of protocol version 1 (a message or a chunk header); WireError otherwise. */
export function jsonObject(payload) {
  let text;
  try {
    text = new TextDecoder('utf-8', { fatal: true }).decode(payload);
  } catch {
    throw new WireError('bad_message', 'not UTF-8 JSON: invalid UTF-8');
  }
  const body = parseJson(text);
  if (body === null || typeof body !== 'object' || Array.isArray(body) || body instanceof JsonFloat) {
    throw new WireError('bad_message', 'a message must be a JSON object');
  }
  if (body.v !== VERSION) throw new WireError('bad_message', `unsupported protocol version ${shown(body.v)}, this peer speaks ${VERSION}`);
  return body;
}

// ------------------------------------------------------------------ field checks

const int = (low = 0, high = MAX_JSON_INT) => (name, v) => {
  if (!isInt(v) || v < low || v > high) throw new WireError('bad_message', `${name} must be an integer in ${low}..${high}, got ${shown(v)}`);
  return v;
};
const number = (limit = Infinity) => (name, v) => {
  // an integer beyond 2^53 is still a number (fedper.wire takes it as a float; one beyond the double range is not)
  const n = v instanceof JsonFloat ? v.value : typeof v === 'bigint' ? Number(v) : v;
  if (typeof n !== 'number' || !Number.isFinite(n) || Math.abs(n) > limit) {
    throw new WireError('bad_message', `${name} must be a finite number of magnitude <= ${limit}, got ${shown(v)}`);
  }
  return n;
};
const text = (max, pattern = null, choices = null) => (name, v) => {
  if (typeof v !== 'string' || v.length > max) throw new WireError('bad_message', `${name} must be a string of at most ${max} characters`);
  if ((pattern && !pattern.test(v)) || (choices && !choices.includes(v))) {
    throw new WireError('bad_message', `${name} ${shown(v)} must be ${choices ? choices.join(' or ') : `like ${pattern.source}`}`);
  }
  return v;
};
const optional = (check) => (name, v) => (v === null ? null : check(name, v));
const metrics = (name, v) => {
  if (v === null || typeof v !== 'object' || Array.isArray(v) || v instanceof JsonFloat || Object.keys(v).length > MAX_METRICS) {
    throw new WireError('bad_message', `${name} must be an object of at most ${MAX_METRICS} numbers`);
  }
  const out = {};
  for (const [k, x] of Object.entries(v)) {
    if (!NAME_RE.test(k)) throw new WireError('bad_message', `${name}: name ${shown(k)} must match ${NAME_RE.source}`);
    out[k] = number(MAX_METRIC_VALUE)(`${name}.${k}`, x);
  }
  return out;
};

/** A generated field's check (schema.js: Python's fullmatch is a pattern anchored at both ends). */
function check(field) {
  const made = {
    int: () => int(field.low, field.high),
    number: () => number(),
    text: () => text(field.max, field.pattern ? new RegExp(`^(?:${field.pattern})$`) : null, field.choices ?? null),
    metrics: () => metrics,
  }[field.type]();
  return field.nullable ? optional(made) : made;
}

/** [field, check, default] per field of each message; a field with a default may be left out. */
const CHECKS = Object.fromEntries(Object.entries(SCHEMAS).map(([kind, fields]) => [kind,
  fields.map((f) => ('default' in f ? [f.name, check(f), f.default] : [f.name, check(f)]))]));

/** A message's fields from a parsed JSON object, each checked; WireError('bad_message') otherwise. */
export function fromDict(kind, body) {
  const out = {};
  for (const [name, checked, ...rest] of CHECKS[kind]) {
    if (!Object.hasOwn(body, name)) {
      if (rest.length) { out[name] = structuredClone(rest[0]); continue; }
      throw new WireError('bad_message', `${kind}: missing field '${name}'`);
    }
    out[name] = checked(`${kind}.${name}`, body[name]);
  }
  return out;
}

export const decodeMessage = (kind, payload) => fromDict(kind, jsonObject(payload));

/** A message's fields checked and in declaration order (fedper.wire's Message.to_dict; a chunk's meta). */
export function messageFields(kind, fields) {
  const checked = fromDict(kind, fields);
  return Object.fromEntries(CHECKS[kind].map(([name]) => [name, checked[name]]));
}

/** A message as fedper.wire encodes it: {"v":1, fields in declaration order}, compact. */
export function encodeMessage(kind, fields) {
  return encoder.encode(JSON.stringify({ v: VERSION, ...messageFields(kind, fields) }));
}

// ------------------------------------------------------------------ chunk frames (section 5)

/** u32 header length, u32 CRC-32 of header + body (big-endian), the JSON header, the body. */
export function encodeFrame(header, body) {
  const head = encoder.encode(JSON.stringify({ v: VERSION, ...header }));
  const frame = new Uint8Array(8 + head.length + body.length);
  const view = new DataView(frame.buffer);
  view.setUint32(0, head.length);
  view.setUint32(4, crc32(body, crc32(head)));
  frame.set(head, 8);
  frame.set(body, 8 + head.length);
  return frame;
}

export function decodeFrame(payload) {
  if (payload.length < 8) throw new WireError('bad_chunk', `truncated frame: ${payload.length} bytes, shorter than its 8-byte prefix`);
  const view = new DataView(payload.buffer, payload.byteOffset, payload.byteLength);
  const n = view.getUint32(0), crc = view.getUint32(4);
  if (n > MAX_HEADER_SIZE) throw new WireError('bad_chunk', `frame header of ${n} bytes exceeds ${MAX_HEADER_SIZE}`);
  if (payload.length < 8 + n) throw new WireError('bad_chunk', `truncated frame: header says ${n} bytes, ${payload.length - 8} present`);
  if (crc32(payload.subarray(8)) !== crc) throw new WireError('bad_chunk', 'corrupt or truncated frame: crc32 mismatch');
  return [jsonObject(payload.subarray(8, 8 + n)), payload.subarray(8 + n)];
}

export const chunkCount = (size, chunkSize) => Math.max(1, Math.ceil(size / chunkSize));

/** A blob as chunk frames (an empty blob is one empty chunk). */
export function chunkBlob(blob, chunkSize, blobId, meta) {
  if (!(chunkSize >= 1 && chunkSize <= MAX_CHUNK_SIZE)) throw new RangeError(`chunk_size must be in 1..${MAX_CHUNK_SIZE}`);
  checkName(blobId, 'blob_id');
  const sha256 = sha256Hex(blob), count = chunkCount(blob.length, chunkSize);
  const frames = [];
  for (let index = 0; index < count; index++) {
    const header = { blob_id: blobId, index, count, size: blob.length, chunk_size: chunkSize, sha256, meta };
    frames.push(encodeFrame(header, blob.subarray(index * chunkSize, (index + 1) * chunkSize)));
  }
  return frames;
}

/** One chunk, checked on its own: CRC, fields, ranges, length. */
export function decodeChunk(payload, maxBlobSize = null) {
  const [h, data] = decodeFrame(payload);
  for (const key of ['blob_id', 'index', 'count', 'size', 'chunk_size', 'sha256', 'meta']) {
    if (!Object.hasOwn(h, key)) throw new WireError('bad_chunk', `chunk header lacks '${key}'`);
  }
  for (const key of ['index', 'count', 'size', 'chunk_size']) {
    if (!isInt(h[key]) || h[key] < 0 || h[key] > MAX_JSON_INT) throw new WireError('bad_chunk', `chunk ${key} must be an integer in 0..${MAX_JSON_INT}, got ${shown(h[key])}`);
  }
  if (typeof h.blob_id !== 'string' || !NAME_RE.test(h.blob_id)) throw new WireError('bad_chunk', `chunk blob_id ${shown(h.blob_id)} must match ${NAME_RE.source}`);
  if (typeof h.sha256 !== 'string' || !SHA256_RE.test(h.sha256)) throw new WireError('bad_chunk', 'chunk sha256 must be 64 lowercase hex digits');
  if (h.meta === null || typeof h.meta !== 'object' || Array.isArray(h.meta) || h.meta instanceof JsonFloat) throw new WireError('bad_chunk', 'chunk meta must be a JSON object');
  if (maxBlobSize !== null && h.size > maxBlobSize) throw new WireError('bad_chunk', `oversized blob: ${h.size} bytes declared, the limit is ${maxBlobSize}`);
  if (h.chunk_size < 1 || h.chunk_size > MAX_CHUNK_SIZE) throw new WireError('bad_chunk', `chunk_size ${h.chunk_size} outside 1..${MAX_CHUNK_SIZE}`);
  if (h.count !== chunkCount(h.size, h.chunk_size) || h.index >= h.count) throw new WireError('bad_chunk', `inconsistent chunk: index ${h.index}, count ${h.count} for ${h.size} bytes / ${h.chunk_size}`);
  const expected = Math.min(h.chunk_size, h.size - h.index * h.chunk_size);
  if (data.length !== expected) throw new WireError('bad_chunk', `chunk ${h.index} holds ${data.length} bytes, expected ${expected}`);
  return { blobId: h.blob_id, index: h.index, count: h.count, size: h.size, chunkSize: h.chunk_size, sha256: h.sha256, meta: h.meta, data };
}

/** The round's model blobs from one source (the coordinator), chunks in any order; at most `maxOpen` partial
 * blobs, the least recently fed displaced first. The same rules as fedper.wire.Reassembler for one source. */
export class Reassembler {
  constructor(maxBlobSize, maxOpen = 4) {
    this.maxBlobSize = maxBlobSize;
    this.maxOpen = maxOpen;
    this.open = new Map(); // blob id -> {first, parts: Map(index -> data), key}
  }

  /** The complete blob {blobId, data, meta, sha256} when this chunk completes one, else null. */
  add(chunk) {
    const key = JSON.stringify([chunk.count, chunk.size, chunk.chunkSize, chunk.sha256, canonical(chunk.meta)]);
    let partial = this.open.get(chunk.blobId);
    if (!partial) {
      while (this.open.size >= this.maxOpen) this.open.delete(this.open.keys().next().value);
      partial = { key, parts: new Map() };
    }
    this.open.delete(chunk.blobId);
    this.open.set(chunk.blobId, partial); // most recently fed last
    if (key !== partial.key) {
      this.open.delete(chunk.blobId);
      throw new WireError('bad_chunk', `inconsistent chunk ${chunk.index} of ${chunk.blobId}: its header differs from the first one's`);
    }
    const seen = partial.parts.get(chunk.index);
    if (seen) {
      if (seen.length !== chunk.data.length || seen.some((b, i) => b !== chunk.data[i])) {
        this.open.delete(chunk.blobId);
        throw new WireError('bad_chunk', `chunk ${chunk.index} of ${chunk.blobId} sent twice with different content`);
      }
      return null;
    }
    partial.parts.set(chunk.index, chunk.data.slice());
    if (partial.parts.size < chunk.count) return null;
    this.open.delete(chunk.blobId);
    const data = new Uint8Array(chunk.size);
    for (let i = 0; i < chunk.count; i++) data.set(partial.parts.get(i), i * chunk.chunkSize);
    if (sha256Hex(data) !== chunk.sha256) throw new WireError('bad_chunk', `corrupt blob ${chunk.blobId}: sha256 mismatch`);
    return { blobId: chunk.blobId, data, meta: chunk.meta, sha256: chunk.sha256 };
  }
}

/** A parsed JSON value as text with sorted keys and plain numbers: equal values give equal text. */
function canonical(v) {
  if (v instanceof JsonFloat) return v.value;
  if (typeof v === 'bigint') return `${v}n`;
  if (Array.isArray(v)) return v.map(canonical);
  if (v && typeof v === 'object') return Object.fromEntries(Object.keys(v).sort().map((k) => [k, canonical(v[k])]));
  return v;
}
