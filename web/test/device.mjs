// The page's modules as one device of a fleet, in node (onnxruntime-web's wasm, as in the browser, bit for bit):
// for benchmarks/web.py's accuracy comparison. Its images are the first COUNT digits of CLASSES from OFFSET (as
// helpers.mjs digits() and web/test/reference.py give them). Prints one JSON line: the final accuracy and metrics.
//
//   node web/test/device.mjs BROKER FLEET DEVICE EXPORT CLASSES COUNT OFFSET SEED LR BATCH EPOCHS

import mqtt from 'mqtt';

import { Agent } from '../src/agent.js';
import { openArtifacts } from '../src/artifacts.js';
import { localData } from '../src/dataset.js';
import { MemoryStore } from '../src/store.js';
import { Trainer } from '../src/trainer.js';
import { runAgent } from '../src/transport.js';
import { digits, fileReader, loadOrt } from './helpers.mjs';

const [broker, fleet, device, dir, classes, count, offset, seed, lr, batch, epochs] = process.argv.slice(2);
const ort = await loadOrt();
const { manifest, read } = await openArtifacts(fileReader(dir));
const trainer = await Trainer.open(ort, manifest, read);
const store = new MemoryStore();
const data = await localData(digits(JSON.parse(classes), Number(count), Number(offset)), manifest, store, Number(seed));
const rounds = [];
const agent = new Agent({
  config: { fleet, clientId: device, seed: Number(seed), lr: Number(lr), batchSize: Number(batch), localEpochs: Number(epochs) },
  manifest, trainer, data, store, log: (line) => { rounds.push(line); console.error(line); },
});
const reason = await runAgent(agent, mqtt, broker, { spreadS: 1 }).done;
console.log(JSON.stringify({ reason, final: agent.finalAccuracy, log: rounds }));
