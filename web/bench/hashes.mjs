// SHA-256 and SHAKE128 on the page's blob sizes: @noble/hashes (what web/src/hash.js uses) against the hand-written
// versions the page had before (web/src/hash.js at REV, read with git). The sizes: a width-0.25 and a width-1.0
// export's checkpoint and an update blob (SHA-256), int8-delta-rot's sign stream for
// rows of 1,024 and 65,536 values, the largest it rotates (SHAKE128). Prints one JSON line per size: MB/s of each, the median of 5 runs, and whether the digests agree.
//
//   node web/bench/hashes.mjs [REV]   (REV: a commit whose web/src/hash.js is the hand-written one; default 981e0c1)

import { execFileSync } from 'node:child_process';
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { sha256 } from '@noble/hashes/sha2.js';
import { shake128 } from '@noble/hashes/sha3.js';
import { bytesToHex } from '@noble/hashes/utils.js';

const rev = process.argv[2] ?? '981e0c1';
const old = join(mkdtempSync(join(tmpdir(), 'hashes-')), 'hash.mjs');
writeFileSync(old, execFileSync('git', ['show', `${rev}:web/src/hash.js`]));
const hand = await import(old);

const median = (xs) => xs.sort((a, b) => a - b)[xs.length >> 1];
const rate = (bytes, fn) => {
  fn(); // warm-up
  return median(Array.from({ length: 5 }, () => {
    const t = performance.now();
    fn();
    return bytes / 1e3 / (performance.now() - t); // MB/s
  }));
};
const random = (n) => Uint8Array.from({ length: n }, (_, i) => (i * 2654435761) >>> 24);

for (const [what, size] of [['update blob, width 0.25', 880_000], ['checkpoint, width 0.25', 1_160_000], ['checkpoint, width 1.0', 13_000_000]]) {
  const data = random(size);
  const same = hand.sha256Hex(data) === bytesToHex(sha256(data));
  console.log(JSON.stringify({ hash: 'sha256', what, bytes: size, handMBs: rate(size, () => hand.sha256Hex(data)), nobleMBs: rate(size, () => bytesToHex(sha256(data))), same }));
}
const seed = new TextEncoder().encode('fedper int8-delta-rot');
for (const values of [1024, 65_536]) { // a rotated row's length: a power of two, at most codecs.js's ROTATED_MAX
  const length = (values + 7) >> 3;
  const same = bytesToHex(hand.shake128(seed, length)) === bytesToHex(shake128(seed, { dkLen: length }));
  console.log(JSON.stringify({ hash: 'shake128', what: `signs of ${values} values`, bytes: length, handMBs: rate(length, () => hand.shake128(seed, length)), nobleMBs: rate(length, () => shake128(seed, { dkLen: length })), same }));
}
