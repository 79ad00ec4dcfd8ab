// The page: a device of the fleet. Reads /config.json (broker, fleet, artifacts; the URL's ?broker=, ?fleet=,
// ?device= and the training options override it) and a provisioning link's #device=&password=, loads and checks the
// export, keeps the user's images and the device's state in IndexedDB, and runs the agent over MQTT on WebSockets.
// Training runs in a Web Worker (worker.js), so the page answers taps meanwhile and shows each step's progress.
// Its log is kept in localStorage (the last LOG_LINES lines), so a reload shows what came before. Everything else
// is in the modules.

import mqtt from './vendor/mqtt.esm.js';
import { Agent, DEFAULTS } from './agent.js';
import { httpFiles, openArtifacts } from './artifacts.js';
import { chanceWords } from './chance.js';
import { localData } from './dataset.js';
import { memoryLine } from './device_check.js';
import { resizeBilinear } from './images.js';
import { photoInput, topClasses } from './predict.js';
import { WorkerTrainer } from './remote.js';
import { IndexedDBStore } from './store.js';
import { runAgent } from './transport.js';

const $ = (id) => document.getElementById(id);
const LOG_LINES = 500;
const LOG_KEY = 'fedper-log';
const lines = JSON.parse(localStorage.getItem(LOG_KEY) ?? '[]');

function log(line) {
  lines.push(`${new Date().toISOString().slice(11, 19)} ${line}`);
  lines.splice(0, lines.length - LOG_LINES);
  try {
    localStorage.setItem(LOG_KEY, JSON.stringify(lines));
  } catch { /* storage full or refused: the log still shows on the page */ }
  const box = $('log');
  box.textContent = `${lines.join('\n')}\n`;
  box.scrollTop = box.scrollHeight;
}

function status(text) {
  $('status').textContent = text;
}

/** Whether wasm threads can run here: they need shared memory, which a browser gives a cross-origin isolated page
 * only (and only in a secure context: https or localhost). hardwareConcurrency alone says nothing about that. */
function canThread() {
  return self.crossOriginIsolated === true && typeof SharedArrayBuffer !== 'undefined';
}

/** One line: why this page runs one thread. */
function whyOneThread() {
  if (!self.isSecureContext) return 'one thread: plain http is not a secure context, so no shared memory; open the https address';
  if (!self.crossOriginIsolated) return 'one thread: the page is not cross-origin isolated (its server sends no COOP/COEP headers)';
  return 'one thread: this browser has no SharedArrayBuffer';
}

/** Over plain http (other than loopback) a browser withholds cross-origin isolation and crypto.subtle: say on screen
 * what that costs this page and how the operator fixes it. */
function explainPlainHttp() {
  if (self.isSecureContext) return;
  const box = $('lacks');
  box.textContent = 'Plain http: the browser gives this page neither cross-origin isolation, so it trains on one thread '
    + '(slower), nor a wake lock (keep the screen on), nor crypto.subtle (not needed: it hashes in JavaScript). '
    + 'For threads, open the https address: '
    + 'fedper-coordinator --web-cert/--web-key, or nginx (deploy/README.md).';
  box.hidden = false;
}

/** The run's settings: config.json, then the URL's query parameters. */
async function settings() {
  const response = await fetch('config.json').catch(() => null);
  const config = response?.ok ? await response.json() : {};
  const q = new URLSearchParams(location.search);
  const number = (key, fallback) => (q.has(key) ? Number(q.get(key)) : config[key] ?? fallback);
  return {
    broker: q.get('broker') ?? config.broker,
    fleet: q.get('fleet') ?? config.fleet,
    artifacts: new URL(config.artifacts ?? 'artifacts/', location.href),
    device: q.get('device'),
    // one core stays with the page (its taps, its status) while the worker and its threads train on the others
    threads: number('threads', canThread() ? Math.max(1, Math.min(4, (navigator.hardwareConcurrency || 1) - 1)) : 1),
    training: {
      lr: number('lr', DEFAULTS.lr), localEpochs: number('epochs', DEFAULTS.localEpochs),
      batchSize: number('batch', DEFAULTS.batchSize), seed: number('seed', DEFAULTS.seed),
      codec: q.get('codec') ?? config.codec ?? DEFAULTS.codec,
    },
  };
}

/** This browser's device id and broker password: ?device=, else the provisioning link's fragment
 * (#device=ID&password=PW, deploy/provision-device.sh: a fragment never reaches a server), kept with the browser's
 * state and removed from the address bar, else what was kept, else an id drawn once (and no password). */
async function identity(chosen) {
  const shared = await IndexedDBStore.open(indexedDB, 'fedper');
  const fragment = new URLSearchParams(location.hash.slice(1));
  if (fragment.has('device')) {
    await shared.put('identity', { device: fragment.get('device'), password: fragment.get('password') ?? undefined });
    history.replaceState(null, '', location.pathname + location.search);
  }
  let kept = await shared.get('identity');
  if (!kept?.device) {
    kept = { device: `web-${[...crypto.getRandomValues(new Uint8Array(4))].map((b) => b.toString(16).padStart(2, '0')).join('')}` };
    await shared.put('identity', kept);
  }
  return chosen && chosen !== kept.device ? { device: chosen } : kept;
}

/** A picked image file as RGB bytes at the model's input size (decoded by the browser, resized as Pillow does). */
async function decode(file, width, height) {
  const { rgb, size } = await readRGB(file);
  return resizeBilinear(rgb, ...size, width, height);
}

/** A picked image file decoded by the browser: {rgb (height x width x 3 bytes), size: [width, height]}. */
async function readRGB(file) {
  const bitmap = await createImageBitmap(file, { colorSpaceConversion: 'none', premultiplyAlpha: 'none' });
  const canvas = new OffscreenCanvas(bitmap.width, bitmap.height);
  const context = canvas.getContext('2d');
  context.drawImage(bitmap, 0, 0);
  const rgba = context.getImageData(0, 0, bitmap.width, bitmap.height).data;
  const rgb = new Uint8Array(bitmap.width * bitmap.height * 3);
  for (let p = 0; p < bitmap.width * bitmap.height; p++) rgb.set(rgba.subarray(4 * p, 4 * p + 3), 3 * p);
  const size = [bitmap.width, bitmap.height];
  bitmap.close();
  return { rgb, size };
}

async function main() {
  log(`page opened at ${location.host}`); // also shows the kept log: the lines above it are from before
  explainPlainHttp();
  const s = await settings();
  const { device, password } = await identity(s.device);
  $('who').textContent = `device ${device} · fleet ${s.fleet ?? '?'} · broker ${s.broker ?? '?'}`;
  if (!s.broker || !s.fleet) throw new Error('no broker or fleet: open the URL the coordinator prints, or add ?broker=ws://HOST:PORT&fleet=NAME');
  const store = await IndexedDBStore.open(indexedDB, `fedper-${device}`);
  const { manifest } = await openArtifacts(httpFiles(s.artifacts));
  const started = performance.now();
  const trainer = await WorkerTrainer.open(manifest, s.artifacts, s.threads);
  log(`model ${manifest.model.architecture} (${manifest.algorithm}, ${manifest.classes.length} classes) ready in ${((performance.now() - started) / 1000).toFixed(1)} s; onnxruntime-web with ${trainer.threads} thread(s) in a worker${canThread() ? '' : ` (${whyOneThread()})`}`);
  log(memoryLine(manifest, navigator.deviceMemory));

  const [, height, width] = manifest.model.input_shape;
  let images = (await store.get('images')) ?? [];
  let run = null, agent = null, wakeLock = null;
  for (const c of manifest.classes) $('class').add(new Option(c, c));
  const showCounts = () => {
    const counts = manifest.classes.map((c) => `${c}: ${images.filter((im) => im.label === c).length}`);
    $('counts').textContent = `${images.length} image(s) · ${counts.join(' · ')}`;
    $('join').disabled = images.length < 2 || run !== null;
  };
  const describe = () => {
    if (!agent) return images.length < 2 ? 'add at least two images, then join' : 'ready to join';
    const chance = chanceWords(agent.data.yTest);
    if (agent.finalAccuracy !== null) return `finished: personalized accuracy ${(100 * agent.finalAccuracy).toFixed(1)} % (${chance})`;
    const info = agent.round;
    if (!info) return 'connecting…';
    const sent = agent.saved && agent.saved.round === info.round;
    const accuracy = agent.saved?.metrics?.accuracy;
    return `round ${info.round} of ${info.rounds}: ${sent ? 'update sent' : 'taking part'}${accuracy === undefined ? '' : ` · accuracy ${(100 * accuracy).toFixed(1)} % (${chance})`}${training()}`;
  };
  const training = () => {
    const p = trainer.progress;
    if (!p) return '';
    return ` · training ${p.trained}: epoch ${p.epoch}/${p.epochs} · step ${p.step}/${p.steps} · ${p.samplesPerS.toFixed(0)} samples/s · ${Math.ceil(p.secondsLeft)} s left`;
  };
  trainer.onProgress = () => status(describe());

  const start = async () => {
    await store.put('joined', true);
    const data = await localData(images, manifest, store, s.training.seed, log);
    agent = new Agent({ config: { fleet: s.fleet, clientId: device, ...s.training }, manifest, trainer, data, store, log });
    await agent.restore();
    log(`${device}: ${data.yTrain.length} training / ${data.yTest.length} test images, connecting to ${s.broker}`);
    wakeLock = await navigator.wakeLock?.request('screen').catch(() => null); // a sleeping phone stops training
    log(`keep this page in front while the fleet runs: a phone pauses a page behind others${wakeLock ? '; the screen stays on meanwhile' : ' (this browser cannot keep the screen on here: it may sleep)'}`);
    const credentials = password ? { username: device, password } : {};
    run = runAgent(agent, mqtt, s.broker, { ...credentials, log, onChange: () => status(describe()) });
    showCounts();
    status(describe());
    run.done.then((reason) => {
      log(`stopped (${reason})`);
      wakeLock?.release().catch(() => {});
      run = null;
      showCounts();
      status(describe());
      offerPanel();
    });
  };
  const restart = async () => {
    if (!run) return;
    log('the images changed: joining again with them');
    const stopping = run;
    await stopping.stop();
    await stopping.done;
    await start();
  };
  const add = async (files) => {
    const label = $('class').value;
    for (const file of files) {
      try {
        images.push({ name: file.name, label, pixels: await decode(file, width, height) });
      } catch (e) {
        log(`cannot read ${file.name}: ${e.message}`);
      }
    }
    await store.put('images', images);
    showCounts();
    status(describe()); // before joining the status says whether the images are enough
    await restart();
  };
  // "what is this?": the final served model (base + this device's head, kept in the store by Agent.finish) answers
  // for one photo; everything it needs is in this tab, so it answers with the broker gone too
  let final = null;
  const offerPanel = async () => {
    final = await store.get('final');
    for (const id of ['ask-photo', 'ask-camera']) $(id).disabled = !final;
    $('ask-model').textContent = final
      ? `Your personalized model after round ${final.rounds} answers, here in this browser.`
      : 'Once the fleet has finished, your personalized model answers here.';
  };
  const ask = async (file) => {
    if (!file || !final) return;
    try {
      const { rgb, size } = await readRGB(file);
      const logits = await trainer.logits(photoInput(rgb, ...size, manifest.model), final.served);
      const top = topClasses(logits, manifest.classes, 3);
      if ($('ask-image').src) URL.revokeObjectURL($('ask-image').src);
      $('ask-image').src = URL.createObjectURL(file);
      $('ask-image').hidden = false;
      $('answer').replaceChildren(...top.map(({ name, probability }) => {
        const item = document.createElement('li');
        item.textContent = `${name}: ${(100 * probability).toFixed(1)} %`;
        return item;
      }));
      window.fedper.answer = { file: file.name, logits: Array.from(logits), top };
    } catch (e) {
      log(`cannot answer for ${file.name}: ${e.message}`);
    }
  };
  $('ask-photo').addEventListener('change', (e) => ask(e.target.files[0]));
  $('ask-camera').addEventListener('change', (e) => ask(e.target.files[0]));
  $('photos').addEventListener('change', (e) => add([...e.target.files]));
  $('camera').addEventListener('change', (e) => add([...e.target.files]));
  $('join').addEventListener('click', () => start().catch((e) => log(`cannot join: ${e.message}`)));
  $('forget').addEventListener('click', async () => {
    await run?.stop();
    for (const key of ['device', 'images', 'split', 'final', 'joined']) await store.delete(key);
    localStorage.removeItem(LOG_KEY);
    images = [];
    location.reload();
  });
  window.fedper = { manifest, trainer, store, lines, device, agent: () => agent, running: () => run !== null, status: describe };
  showCounts();
  status(describe());
  await offerPanel();
  if (images.length >= 2 && (await store.get('joined'))) await start(); // a reload rejoins by itself
}

main().catch((e) => {
  log(`error: ${e.message}`);
  status(`cannot start: ${e.message}`);
});
