// The page's training speed in a browser engine (ENGINE=chromium, the default, firefox or webkit: engines.mjs), for
// benchmarks/web.py and benchmarks/web_engines.py: on a cross-origin isolated page of the served root, import the
// page's own modules, open the export's sets (timed: the session start) with onnxruntime-web on THREADS wasm threads
// (one where the page has no shared memory, as the page does), and train the page's Trainer on random 32x32 data,
// one warm-up epoch then REPEATS measured ones. Prints one JSON line: {startS, samplesPerS: [...], isolated, threads}.
//
//   node web/test/browser/bench.mjs ORIGIN THREADS SAMPLES BATCH REPEATS

import { ENGINE, launch } from './engines.mjs';

const [origin, threads, samples, batch, repeats] = process.argv.slice(2);
const browser = await launch(ENGINE, 1800);
try {
  const page = await browser.newPage();
  await page.goto(`${origin}/config.json`); // any page of the origin: same origin as the modules, isolated
  const result = await page.evaluate(async (threadCount, n, batchSize, times) => {
    const ort = await import('/vendor/ort/ort.training.wasm.mjs');
    const { openArtifacts } = await import('/artifacts.js');
    const { Trainer } = await import('/trainer.js');
    ort.env.wasm.numThreads = self.crossOriginIsolated && typeof SharedArrayBuffer !== 'undefined' ? threadCount : 1;
    const { manifest, read } = await openArtifacts(async (path) => new Uint8Array(await (await fetch(`/artifacts/${path}`)).arrayBuffer()));
    const files = {};
    for (const folder of Object.values(manifest.artifactSets)) {
      for (const name of ['checkpoint', 'training_model.web.onnx', 'eval_model.onnx', 'optimizer_model.onnx']) files[`${folder}/${name}`] = await read(`${folder}/${name}`);
    }
    const started = performance.now();
    const trainer = await Trainer.open(ort, manifest, async (path) => files[path]);
    const startS = (performance.now() - started) / 1000;
    const [c, h, w] = manifest.model.input_shape;
    const x = Float32Array.from({ length: n * c * h * w }, () => Math.random() * 2 - 1);
    const y = Array.from({ length: n }, (_, i) => i % manifest.model.num_classes);
    const kind = Object.keys(manifest.artifactSets)[0];
    await trainer.train(kind, x, y, { epochs: 1, batchSize, lr: 0.01, seed: [0, 0, 0] });
    const samplesPerS = [];
    for (let r = 0; r < times; r++) {
      const stats = await trainer.train(kind, x, y, { epochs: 1, batchSize, lr: 0.01, seed: [0, r + 1, 0] });
      samplesPerS.push(stats.samples / stats.seconds);
    }
    return { startS, samplesPerS, isolated: self.crossOriginIsolated, threads: ort.env.wasm.numThreads };
  }, Number(threads), Number(samples), Number(batch), Number(repeats));
  console.log(JSON.stringify(result));
} finally {
  await browser.close();
}
