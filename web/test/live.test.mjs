// The web agent's protocol against the real thing, in node: a real Mosquitto, the real fedper-coordinator and a
// real fedper-agent, with the page's modules as the third device (its update compressed with int8-delta-rot).
// Halfway the page "reloads" (a new agent and trainer on the same store) and rejoins with its head. Every update
// frame on the broker is captured by a separate client: none carries a head tensor.

import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { existsSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'node:test';

import mqtt from 'mqtt';

import { Agent } from '../src/agent.js';
import { openArtifacts } from '../src/artifacts.js';
import { localData } from '../src/dataset.js';
import { decodeSafetensors } from '../src/safetensors.js';
import { MemoryStore } from '../src/store.js';
import { Trainer } from '../src/trainer.js';
import { runAgent } from '../src/transport.js';
import { Reassembler, decodeChunk } from '../src/wire.js';
import { MOSQUITTO, PYTHON, REPO, digits, exportTiny, fileReader, loadOrt, python, startMosquitto, tempDir } from './helpers.mjs';

const FLEET = 'live';
const ROUNDS = 3;

async function waitFor(check, what, seconds = 240) {
  for (let i = 0; i < seconds * 10; i++) {
    const value = check();
    if (value) return value;
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error(`timed out waiting for ${what}`);
}

test('the page takes part in FedPer rounds with a Python agent, rejoins after a reload, sends no head tensor', { skip: !MOSQUITTO && 'mosquitto not installed', timeout: 600_000 }, async () => {
  const dir = exportTiny();
  const work = tempDir();
  const broker = await startMosquitto();
  const children = [];
  try {
    python(`
import sys, numpy as np
from fedper.data import load_digits
ds = load_digits(32).train
idx = np.flatnonzero(np.isin(ds.y, [0, 1, 2, 3]))[100:160]
np.savez(sys.argv[1], x_train=ds.x[idx], y_train=ds.y[idx], classes=np.array(["0", "1", "2", "3"]))`, join(work, 'python.npz'));
    const state = join(work, 'coordinator');
    const run = (name, args) => {
      const log = join(work, `${name}.log`);
      const child = spawn(PYTHON, args, { cwd: REPO, stdio: ['ignore', 'pipe', 'pipe'] });
      const lines = [];
      child.stdout.on('data', (d) => lines.push(String(d)));
      child.stderr.on('data', (d) => lines.push(String(d)));
      child.on('exit', () => writeFileSync(log, lines.join('')));
      children.push(child);
      return lines;
    };
    const coordinatorLog = run('coordinator', ['-m', 'fedper.coordinator.cli', '--artifacts', dir, '--fleet', FLEET, '--broker', broker.url,
      '--rounds', String(ROUNDS), '--min-clients', '2', '--round-timeout', '120', '--state-dir', state]);
    run('agent', ['-m', 'fedper.edge.cli', '--artifacts', dir, '--data', join(work, 'python.npz'), '--broker', broker.url,
      '--fleet', FLEET, '--client-id', 'python-1', '--state-dir', join(work, 'agent'), '--batch-size', '16', '--lr', '0.02', '--seed', '3']);

    const seen = new Reassembler(10_000_000, 16);
    const updates = [];
    const spy = mqtt.connect(broker.url, { clientId: 'spy' });
    spy.on('message', (topic, payload) => {
      const blob = seen.add(decodeChunk(new Uint8Array(payload)));
      if (blob) updates.push({ device: topic.split('/').at(-1), blob });
    });
    await spy.subscribeAsync(`fedper/v1/${FLEET}/update/#`, { qos: 1 });

    const ort = await loadOrt();
    const store = new MemoryStore(); // IndexedDB's stand-in: the browser test reloads a real page
    const lines = [];
    const images = digits([0, 1, 2, 3], 60);
    const start = async () => {
      const { manifest, read } = await openArtifacts(fileReader(dir));
      const trainer = await Trainer.open(ort, manifest, read);
      const data = await localData(images, manifest, store, 3);
      const agent = new Agent({ config: { fleet: FLEET, clientId: 'web-1', batchSize: 16, lr: 0.02, seed: 3, codec: 'int8-delta-rot' }, manifest, trainer, data, store, log: (l) => lines.push(l) });
      await agent.restore();
      return { agent, trainer, manifest, run: runAgent(agent, mqtt, broker.url, { spreadS: 1 }) };
    };
    let page = await start();
    await waitFor(() => page.agent.lastSent >= 1, 'the page to send its round-1 update');
    await page.run.stop(); // the reload: the page goes away and comes back with its store
    const saved = await store.get('device');
    page = await start();
    assert.ok(lines.includes('restored the head of round 1 from this browser\'s storage'), lines.join('\n'));
    for (const name of page.manifest.names({ shared: false })) assert.deepEqual(page.trainer.read([name]).get(name), saved.local[name]);
    assert.equal(await page.run.done, 'finished');

    const closed = () => {
      const path = join(state, 'metrics.jsonl');
      const rounds = existsSync(path) ? readFileSync(path, 'utf-8').trim().split('\n').map(JSON.parse) : [];
      return rounds.some((r) => r.round === ROUNDS) && rounds;
    };
    for (const r of await waitFor(closed, 'the coordinator to close the last round')) {
      assert.equal(r.participants, 2, `round ${r.round}: ${JSON.stringify(r)}\n${coordinatorLog.join('')}`);
      // with every update folded, a refusal can only answer a resend of the reloaded page's saved update
      assert.deepEqual(Object.keys(r.rejected).filter((code) => !['duplicate_update', 'late_update'].includes(code)), [], `round ${r.round}`);
    }
    assert.ok(page.agent.finalAccuracy !== null);
    const heads = new Set(page.manifest.names({ shared: false }));
    const shared = page.manifest.names({ shared: true }).sort();
    const fromPage = updates.filter((u) => u.device === 'web-1');
    assert.ok(fromPage.length >= ROUNDS, `${fromPage.length} updates from the page`);
    for (const { device, blob } of updates) {
      const names = [...decodeSafetensors(blob.data).tensors.keys()].sort();
      assert.ok(!names.some((n) => heads.has(n)), `${device} sent a head tensor`);
      assert.deepEqual(names, shared, device);
    }
    assert.ok(fromPage.every((u) => u.blob.meta.codec === 'int8-delta-rot'));
    await spy.endAsync();
  } finally {
    for (const child of children) child.kill('SIGKILL');
    broker.stop();
  }
});
