// Drives a browser engine (ENGINE=chromium, the default, firefox or webkit: engines.mjs) for tests/test_web_browser.py
// and tests/test_web_engines.py: opens the page as a phone would,
// picks the images of each class with the file picker, joins, reloads the page once its round-`reloadAfter`
// update is out (0: no reload), and waits for the run to finish. Prints one JSON line: what the page showed and logged.
// With SHOTS=DIR it saves what a person sees, as PNGs: at start, mid-round (while taking part) and at the end.
//
//   node web/test/browser/drive.mjs URL IMAGES_DIR RELOAD_AFTER_ROUND TIMEOUT_S

import { readdirSync } from 'node:fs';
import { join } from 'node:path';
import { ENGINE, launch } from './engines.mjs';

const [url, imagesDir, reloadAfter, timeoutS] = process.argv.slice(2);
const deadline = Date.now() + Number(timeoutS) * 1000;
const browser = await launch(ENGINE, Number(timeoutS));
const result = { console: [] };
try {
  const page = await browser.newPage();
  page.on('console', (m) => result.console.push(m.text()));
  page.on('pageerror', (e) => result.console.push(`pageerror: ${e.message}`));
  await page.setViewport({ width: 412, height: 915, deviceScaleFactor: 1, isMobile: true, hasTouch: true });
  const shot = (name) => (process.env.SHOTS ? page.screenshot({ path: join(process.env.SHOTS, `${name}.png`), fullPage: true }) : null);
  const until = async (what, check, ...args) => {
    while (Date.now() < deadline) {
      const value = await page.evaluate(check, ...args).catch(() => null);
      if (value) return value;
      await new Promise((r) => setTimeout(r, 250));
    }
    throw new Error(`timed out waiting for ${what}; status: ${await page.$eval('#status', (e) => e.textContent).catch(() => '?')}`);
  };
  await page.goto(url);
  await until('the model', () => window.fedper !== undefined);
  result.isolated = await page.evaluate(() => self.crossOriginIsolated);
  result.shared = await page.evaluate(() => typeof SharedArrayBuffer !== 'undefined');
  for (const label of readdirSync(imagesDir).sort()) {
    await page.select('#class', label);
    const files = readdirSync(join(imagesDir, label)).sort().map((f) => join(imagesDir, label, f));
    await (await page.$('#photos')).uploadFile(...files);
    await until(`the images of class ${label}`, (text) => document.querySelector('#counts').textContent.includes(text), `${label}: ${files.length}`);
  }
  await until('all images', () => !document.querySelector('#join').disabled);
  await shot('start');
  await page.click('#join');
  await until('a round', () => document.querySelector('#status').textContent.includes('taking part'));
  await shot('mid-round');
  if (Number(reloadAfter) > 0) {
    result.reloadedAfter = await until(`the update of round ${reloadAfter}`, (k) => {
      const sent = window.fedper.agent()?.lastSent ?? 0; // sentRound resets at each RoundInfo: too brief to poll
      return sent >= k && sent;
    }, Number(reloadAfter));
    result.logBeforeReload = await page.evaluate(() => window.fedper.lines);
    await page.reload();
    await until('the page to rejoin', () => window.fedper?.running());
  }
  result.final = (await until('the run to finish', () => window.fedper.agent()?.finalAccuracy != null && { accuracy: window.fedper.agent().finalAccuracy })).accuracy;
  result.status = await page.$eval('#status', (e) => e.textContent);
  await shot('end');
  result.log = await page.evaluate(() => window.fedper.lines);
  result.device = await page.evaluate(() => window.fedper.device);
} catch (e) {
  result.error = e.message;
} finally {
  await browser.close();
  console.log(JSON.stringify(result));
}
