// The hashes the protocol names: CRC-32 (chunk frames), here in plain JavaScript, and SHA-256 (blobs, files,
// base_digest) and SHAKE128 (int8-delta-rot's signs) from @noble/hashes (audited; 5x and 20x the hand-written versions
// this file had on the page's blob sizes: web/bench/hashes.mjs). Not WebCrypto: crypto.subtle exists only in a
// secure context, and a phone may open the page over plain http on a local network; these are also synchronous.

import { sha256 } from '@noble/hashes/sha2.js';
import { shake128 as nobleShake128 } from '@noble/hashes/sha3.js';
import { bytesToHex } from '@noble/hashes/utils.js';

const CRC_TABLE = (() => {
  const table = new Uint32Array(256);
  for (let n = 0; n < 256; n++) {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    table[n] = c >>> 0;
  }
  return table;
})();

/** CRC-32 (IEEE 802.3, zlib.crc32) of `bytes`, continuing from `crc`. */
export function crc32(bytes, crc = 0) {
  let c = (crc ^ 0xffffffff) >>> 0;
  for (let i = 0; i < bytes.length; i++) c = CRC_TABLE[(c ^ bytes[i]) & 0xff] ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}

/** SHA-256 of `bytes` (a Uint8Array) as 64 lowercase hex digits. */
export function sha256Hex(bytes) {
  return bytesToHex(sha256(bytes));
}

/** SHAKE128(message) squeezed to `length` bytes. */
export function shake128(message, length) {
  return nobleShake128(message, { dkLen: length });
}
