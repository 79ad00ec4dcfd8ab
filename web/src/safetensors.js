// safetensors (docs/protocol.md section 7): u64 header length, a JSON header, the tensors' bytes back to back.
// Written as the reference writer lays it out (tensors by dtype, largest first, then by name; the header padded
// with spaces to 8 bytes), so an fp32 blob is byte for byte what fedper.payload.encode_shared makes.

export class SafetensorsError extends Error {}

const DTYPES = { F32: [Float32Array, 4, 3], F16: [Uint16Array, 2, 2], U8: [Uint8Array, 1, 1] }; // [array, bytes, rank]

/** Bytes of [{name, dtype, shape, data}] (data: a typed array of the dtype) with optional string metadata. */
export function encodeSafetensors(tensors, metadata = null) {
  const ordered = [...tensors].sort((a, b) => DTYPES[b.dtype][2] - DTYPES[a.dtype][2] || (a.name < b.name ? -1 : a.name > b.name ? 1 : 0));
  const header = {};
  if (metadata) header.__metadata__ = metadata;
  let offset = 0;
  for (const t of ordered) {
    const bytes = t.data.length * DTYPES[t.dtype][1];
    if (t.shape.reduce((a, b) => a * b, 1) !== t.data.length) throw new SafetensorsError(`${t.name}: shape and data disagree`);
    header[t.name] = { dtype: t.dtype, shape: t.shape, data_offsets: [offset, offset + bytes] };
    offset += bytes;
  }
  let head = JSON.stringify(header);
  head += ' '.repeat((8 - (head.length % 8)) % 8);
  const headBytes = new TextEncoder().encode(head);
  const out = new Uint8Array(8 + headBytes.length + offset);
  new DataView(out.buffer).setBigUint64(0, BigInt(headBytes.length), true);
  out.set(headBytes, 8);
  let at = 8 + headBytes.length;
  for (const t of ordered) {
    const raw = new Uint8Array(t.data.buffer, t.data.byteOffset, t.data.byteLength);
    out.set(raw, at); // little-endian: every platform a browser runs on
    at += raw.length;
  }
  return out;
}

/** {tensors: Map(name -> {dtype, shape, data (a copy)}), metadata} of a blob; SafetensorsError when its header or
 * offsets are not sound (each tensor exactly its bytes, back to back, covering the data section). */
export function decodeSafetensors(blob) {
  if (blob.length < 8) throw new SafetensorsError('shorter than its 8-byte header length');
  const n = Number(new DataView(blob.buffer, blob.byteOffset, 8).getBigUint64(0, true));
  if (n > blob.length - 8) throw new SafetensorsError(`header of ${n} bytes in a blob of ${blob.length}`);
  let header;
  try {
    header = JSON.parse(new TextDecoder('utf-8', { fatal: true }).decode(blob.subarray(8, 8 + n)));
  } catch (e) {
    throw new SafetensorsError(`header is not UTF-8 JSON: ${e.message}`);
  }
  if (!header || typeof header !== 'object' || Array.isArray(header)) throw new SafetensorsError('header is not a JSON object');
  const metadata = header.__metadata__ ?? {};
  if (typeof metadata !== 'object' || Array.isArray(metadata) || Object.values(metadata).some((v) => typeof v !== 'string')) {
    throw new SafetensorsError('__metadata__ must map strings to strings');
  }
  const data = blob.subarray(8 + n);
  const entries = Object.entries(header).filter(([k]) => k !== '__metadata__');
  entries.sort((a, b) => (a[1]?.data_offsets?.[0] ?? -1) - (b[1]?.data_offsets?.[0] ?? -1));
  const tensors = new Map();
  let end = 0;
  for (const [name, e] of entries) {
    const kind = DTYPES[e?.dtype];
    if (!kind) throw new SafetensorsError(`${name}: dtype ${e?.dtype} is not one a fedper blob holds`);
    const shape = e.shape, offsets = e.data_offsets;
    if (!Array.isArray(shape) || !shape.every((d) => Number.isSafeInteger(d) && d >= 0)) throw new SafetensorsError(`${name}: bad shape`);
    if (!Array.isArray(offsets) || offsets.length !== 2 || !offsets.every(Number.isSafeInteger)) throw new SafetensorsError(`${name}: bad data_offsets`);
    const count = shape.reduce((a, b) => a * b, 1);
    if (offsets[0] !== end || offsets[1] - offsets[0] !== count * kind[1]) throw new SafetensorsError(`${name}: data_offsets do not tile the data`);
    end = offsets[1];
    const bytes = data.slice(offsets[0], offsets[1]);
    tensors.set(name, { dtype: e.dtype, shape, data: new kind[0](bytes.buffer) });
  }
  if (end !== data.length) throw new SafetensorsError(`the tensors cover ${end} of ${data.length} data bytes`);
  return { tensors, metadata };
}
