// npm run build: the page's static root, dist/ (what fedper.web_root() names and the coordinator serves): the
// page's own ES modules as they are (the one change: '@noble/hashes/X' becomes './vendor/noble-hashes/X', where a
// browser finds it without an import map, workers included), and the vendor files it loads, copied from node_modules
// (onnxruntime-web's patched training build with its wasm, mqtt.js's browser module, @noble/hashes's ES modules).
// Nothing is bundled or fetched. The training worker (worker.js) imports onnxruntime-web from the same vendor/ort/
// as a page script would, and onnxruntime-web finds its wasm and starts its thread workers beside that module.

import { cpSync, mkdirSync, readFileSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const web = dirname(fileURLToPath(import.meta.url));
const dist = join(web, 'dist');
const ort = join(web, 'node_modules', 'onnxruntime-web', 'dist');
const noble = join(web, 'node_modules', '@noble', 'hashes');
const vendor = [
  [join(ort, 'ort.training.wasm.mjs'), 'vendor/ort/ort.training.wasm.mjs'],
  [join(ort, 'ort-training-wasm-simd-threaded.mjs'), 'vendor/ort/ort-training-wasm-simd-threaded.mjs'],
  [join(ort, 'ort-training-wasm-simd-threaded.wasm'), 'vendor/ort/ort-training-wasm-simd-threaded.wasm'],
  [join(web, 'node_modules', 'mqtt', 'dist', 'mqtt.esm.js'), 'vendor/mqtt.esm.js'],
  ...readdirSync(noble).filter((f) => f.endsWith('.js')).map((f) => [join(noble, f), `vendor/noble-hashes/${f}`]),
];

rmSync(dist, { recursive: true, force: true });
for (const folder of ['ort', 'noble-hashes']) mkdirSync(join(dist, 'vendor', folder), { recursive: true });
for (const name of readdirSync(join(web, 'src'))) {
  const text = readFileSync(join(web, 'src', name), 'utf8');
  writeFileSync(join(dist, name), name.endsWith('.js') ? text.replaceAll("from '@noble/hashes/", "from './vendor/noble-hashes/") : text);
}
for (const [from, to] of vendor) cpSync(from, join(dist, to));
console.log(`built ${dist}`);
