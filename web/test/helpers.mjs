// What the node tests share: onnxruntime-web's training build loaded from node_modules (its package exports no
// training entry for node), the repository's Python for exports and reference runs, a real Mosquitto, digits.

import { spawn, spawnSync } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { Socket, createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

export const WEB = resolve(dirname(fileURLToPath(import.meta.url)), '..');
export const REPO = resolve(WEB, '..');
export const VECTORS = join(REPO, 'tests', 'vectors');
export const PYTHON = process.env.FEDPER_PYTHON ?? join(REPO, '.venv', 'bin', 'python');
export const MOSQUITTO = ['/usr/sbin/mosquitto', '/usr/bin/mosquitto'].find(existsSync);

export async function loadOrt(threads = 1) {
  const ort = await import(join(WEB, 'node_modules', 'onnxruntime-web', 'dist', 'ort.training.wasm.mjs'));
  ort.env.wasm.numThreads = threads;
  return ort;
}

const temporary = [];
process.on('exit', () => temporary.forEach((dir) => rmSync(dir, { recursive: true, force: true })));

/** A fresh directory, removed when the test process exits. */
export function tempDir(prefix = 'webagent-test-') {
  const dir = mkdtempSync(join(tmpdir(), prefix));
  temporary.push(dir);
  return dir;
}

/** Run the repository's Python on `code` (with `args` as sys.argv[1:]); its stdout. */
export function python(code, ...args) {
  const done = spawnSync(PYTHON, ['-c', code, ...args], { cwd: REPO, encoding: 'utf-8', maxBuffer: 1 << 28 });
  if (done.status !== 0) throw new Error(`python failed (${done.status}): ${done.stderr.slice(-3000)}`);
  return done.stdout;
}

/** A real fedper-export into a fresh directory (MobileNet-v1 x0.25 32x32 4 classes unless told otherwise). */
export function exportTiny({ algorithm = 'fedper', graph = 'stock', width = 0.25 } = {}) {
  const out = join(tempDir(), 'export');
  python(`
import sys
from fedper.algorithms import get_algorithm
from fedper.export.exporter import export_artifacts
algorithm, graph, width, out = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
export_artifacts(out, model="mobilenet_v1", kp=get_algorithm(algorithm).default_kp, num_classes=4, input_size=32,
                 width=width, algorithm=algorithm, graph=graph, classes=("0", "1", "2", "3"))`, algorithm, graph, String(width), out);
  return out;
}

export const fileReader = (dir) => async (path) => new Uint8Array(readFileSync(join(dir, path)));

/** sklearn's digits at 32x32 RGB (fedper.data.load_digits), the first `count` of the given classes:
 * [{name, label, pixels}] as the page holds its images. */
export function digits(classes, count, offset = 0) {
  const out = python(`
import sys, json, numpy as np
from fedper.data import load_digits
ds = load_digits(32).train
idx = np.flatnonzero(np.isin(ds.y, json.loads(sys.argv[1])))[int(sys.argv[3]):][:int(sys.argv[2])]
sys.stdout.write(json.dumps({"y": ds.y[idx].tolist(), "x": ds.x[idx].ravel().tolist()}))`, JSON.stringify(classes), String(count), String(offset));
  const { x, y } = JSON.parse(out);
  const size = 32 * 32 * 3;
  return y.map((label, i) => ({ name: `digit-${String(offset + i).padStart(4, '0')}.png`, label: String(label), pixels: Uint8Array.from(x.slice(i * size, (i + 1) * size)) }));
}

export function freePort() {
  return new Promise((resolvePort, reject) => {
    const server = createServer();
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address();
      server.close(() => resolvePort(port));
    });
    server.on('error', reject);
  });
}

/** A Mosquitto on a free loopback port: {url, stop()}. */
export async function startMosquitto() {
  const port = await freePort();
  const dir = tempDir('webagent-mosquitto-');
  const user = process.getuid?.() === 0 ? 'user root\n' : '';
  writeFileSync(join(dir, 'mosquitto.conf'), `listener ${port} 127.0.0.1\nallow_anonymous true\npersistence false\n${user}`);
  const proc = spawn(MOSQUITTO, ['-c', join(dir, 'mosquitto.conf')], { stdio: 'ignore' });
  for (let i = 0; i < 100; i++) {
    if (await new Promise((ok) => { const s = new Socket(); s.once('error', () => ok(false)); s.connect(port, '127.0.0.1', () => { s.destroy(); ok(true); }); })) {
      return { url: `mqtt://127.0.0.1:${port}`, port, stop: () => proc.kill() };
    }
    await new Promise((r) => setTimeout(r, 50));
  }
  proc.kill();
  throw new Error('mosquitto did not start');
}
