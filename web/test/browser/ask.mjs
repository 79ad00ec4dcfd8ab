// Drives chromium for tests/test_web_predict.py: the page's "what is this?" panel. Picks the training images with
// the file picker, joins, waits for the fleet to finish, then asks about PHOTO with the panel's picker; asks again
// with the tab offline (chromium's network emulation: nothing it needs may come from the network); prints one JSON
// line (`stage: finished`: the answers, the log, the final served tensors as base64 float32 for the test's
// reference) and waits for a line on stdin, then reloads the page and asks once more (`stage: reloaded`). With
// SHOTS=DIR it saves the panel's answers as PNGs.
//
//   node web/test/browser/ask.mjs URL IMAGES_DIR PHOTO TIMEOUT_S

import { readdirSync } from 'node:fs';
import { join } from 'node:path';
import { createInterface } from 'node:readline';
import { launch, poller } from './engines.mjs';

const [url, imagesDir, photo, timeoutS] = process.argv.slice(2);
const deadline = Date.now() + Number(timeoutS) * 1000;
const browser = await launch('chromium', Number(timeoutS)); // chromium: its network emulation takes the tab offline
const lines = createInterface({ input: process.stdin })[Symbol.asyncIterator]();
const result = { console: [] };
try {
  const page = await browser.newPage();
  page.on('console', (m) => result.console.push(`${m.type()}: ${m.text()}`));
  page.on('pageerror', (e) => result.console.push(`pageerror: ${e.message}`));
  await page.setViewport({ width: 412, height: 915, deviceScaleFactor: 1, isMobile: true, hasTouch: true });
  const shot = (name) => (process.env.SHOTS ? page.screenshot({ path: join(process.env.SHOTS, `${name}.png`), fullPage: true }) : null);
  const until = poller(page, deadline);
  /** Pick PHOTO with one of the panel's inputs: what the page answered and what it shows. */
  const ask = async (input) => {
    await until('the panel', () => !document.querySelector('#ask-photo').disabled);
    await page.evaluate(() => { window.fedper.answer = null; });
    await (await page.$(input)).uploadFile(photo);
    const answer = await until('the answer', () => window.fedper.answer);
    answer.shown = await page.$$eval('#answer li', (items) => items.map((e) => e.textContent));
    answer.model = await page.$eval('#ask-model', (e) => e.textContent);
    return answer;
  };
  await page.goto(url);
  await until('the model', () => window.fedper !== undefined);
  result.before = await page.$eval('#ask-model', (e) => e.textContent);
  result.disabledBefore = await page.$eval('#ask-photo', (e) => e.disabled);
  for (const label of readdirSync(imagesDir).sort()) {
    await page.select('#class', label);
    const files = readdirSync(join(imagesDir, label)).sort().map((f) => join(imagesDir, label, f));
    await (await page.$('#photos')).uploadFile(...files);
    await until(`the images of class ${label}`, (text) => document.querySelector('#counts').textContent.includes(text), `${label}: ${files.length}`);
  }
  await page.click('#join');
  await until('the run to finish', () => window.fedper.agent()?.finalAccuracy != null);
  result.finished = await ask('#ask-photo');
  await shot('ask-finished');
  await page.setOfflineMode(true);
  result.offline = await ask('#ask-camera');
  await page.setOfflineMode(false);
  result.served = await page.evaluate(async () => {
    const { served } = await window.fedper.store.get('final');
    const base64 = (v) => {
      const bytes = new Uint8Array(v.buffer, v.byteOffset, v.byteLength);
      let text = '';
      for (let i = 0; i < bytes.length; i += 8192) text += String.fromCharCode(...bytes.subarray(i, i + 8192));
      return btoa(text);
    };
    return Object.fromEntries(Object.entries(served).map(([name, v]) => [name, base64(v)]));
  });
  result.log = await page.evaluate(() => window.fedper.lines);
  console.log(JSON.stringify({ stage: 'finished', ...result }));
  await lines.next(); // the test has taken the broker away
  await page.reload();
  await until('the model after the reload', () => window.fedper !== undefined);
  const reloaded = { answer: await ask('#ask-photo') };
  await shot('ask-reloaded');
  reloaded.status = await page.$eval('#status', (e) => e.textContent);
  reloaded.log = await page.evaluate(() => window.fedper.lines);
  reloaded.console = result.console;
  console.log(JSON.stringify({ stage: 'reloaded', ...reloaded }));
} catch (e) {
  console.log(JSON.stringify({ stage: 'error', error: e.message, console: result.console }));
} finally {
  await browser.close();
}
