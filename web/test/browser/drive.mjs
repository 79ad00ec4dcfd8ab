// Drives a browser engine (ENGINE=chromium, the default, firefox or webkit: engines.mjs) for tests/test_web_browser.py
// and tests/test_web_engines.py: opens the page as a phone would,
// picks the images of each class with the file picker, joins, reloads the page once its round-`reloadAfter`
// update is out (0: no reload), and waits for the run to finish. Prints one JSON line: what the page showed and logged.
// From the join to the end it times page script calls every 50 ms (`responsiveMs`: those sent or answered while a
// round trained, from sending to the answer; `idleMs` the others) and keeps the status lines shown while training. Before joining it
// opens the same page by a name that is not loopback (phone.test, mapped to 127.0.0.1), which is plain http to the
// browser, and keeps what the page says it lacks there (`plainHttp`).
// With SHOTS=DIR it saves what a person sees, as PNGs: at start, mid-round (while training), at the end, and over
// plain http.
//
//   node web/test/browser/drive.mjs URL IMAGES_DIR RELOAD_AFTER_ROUND TIMEOUT_S

import { readdirSync } from 'node:fs';
import { join } from 'node:path';
import { ENGINE, launch, poller } from './engines.mjs';

const [url, imagesDir, reloadAfter, timeoutS] = process.argv.slice(2);
const deadline = Date.now() + Number(timeoutS) * 1000;
const LOAD_PATIENCE_S = 120; // a load takes seconds, a minute on a loaded machine
const browser = await launch(ENGINE, Number(timeoutS));
const result = { console: [], responsiveMs: [], idleMs: [], trainingStatus: [] };
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
let page;
let sampling = true; // the responsiveness sampler's loop; stopped in `finally` too, or node never exits after an error
try {
  page = await browser.newPage();
  page.on('console', (m) => result.console.push(`${m.type()}: ${m.text()}`));
  page.on('pageerror', (e) => result.console.push(`pageerror: ${e.message}`));
  await page.setViewport({ width: 412, height: 915, deviceScaleFactor: 1, isMobile: true, hasTouch: true });
  const shot = (name, on = page) => (process.env.SHOTS ? on.screenshot({ path: join(process.env.SHOTS, `${name}.png`), fullPage: true }) : null);
  const until = poller(page, deadline);
  // WebKitGTK on a loaded machine now and then never finishes loading the page: it stays at its first status while
  // the web process spins. A person would reload it; so does this, once, and keeps what the page showed (`stuck`).
  result.stuck = [];
  const loads = async (what, check) => {
    try {
      return await poller(page, Math.min(deadline, Date.now() + LOAD_PATIENCE_S * 1000))(what, check);
    } catch (e) {
      const seen = await page.evaluate(() => ({ readyState: document.readyState, log: JSON.parse(localStorage.getItem('fedper-log') ?? '[]').slice(-5) })).catch(() => null);
      result.stuck.push({ what: e.message, seen });
      await page.reload();
      return until(what, check);
    }
  };
  await page.goto(url);
  await loads('the model', () => window.fedper !== undefined);
  result.isolated = await page.evaluate(() => self.crossOriginIsolated);
  result.shared = await page.evaluate(() => typeof SharedArrayBuffer !== 'undefined');
  if (ENGINE === 'chromium') { // the name phone.test is mapped to 127.0.0.1 by chromium's --host-resolver-rules
    const plain = await browser.newPage();
    const phone = new URL(url);
    phone.hostname = 'phone.test';
    await plain.goto(phone.href);
    await plain.waitForSelector('#lacks:not([hidden])', { timeout: 30000 });
    result.plainHttp = await plain.$eval('#lacks', (e) => e.textContent);
    await shot('plain-http', plain);
    await plain.close();
  }
  for (const label of readdirSync(imagesDir).sort()) {
    await page.select('#class', label);
    const files = readdirSync(join(imagesDir, label)).sort().map((f) => join(imagesDir, label, f));
    await (await page.$('#photos')).uploadFile(...files);
    await until(`the images of class ${label}`, (text) => document.querySelector('#counts').textContent.includes(text), `${label}: ${files.length}`);
  }
  await until('all images', () => !document.querySelector('#join').disabled);
  await shot('start');
  result.lacksOnLoopback = await page.$eval('#lacks', (e) => !e.hidden);
  await page.click('#join');
  const sample = async () => { // the page's answer time while a round trains
    let training = false;
    while (sampling) {
      const sent = performance.now();
      const seen = await page.evaluate(() => (window.fedper?.trainer.progress ? document.querySelector('#status').textContent : '')).catch(() => null);
      const ms = performance.now() - sent;
      if (seen || (training && seen !== null)) result.responsiveMs.push(ms);
      else if (seen !== null) result.idleMs.push(ms); // the same call between rounds: what the machine gives
      if (seen && result.trainingStatus.length < 20) result.trainingStatus.push(seen);
      training = Boolean(seen);
      await sleep(50);
    }
  };
  let sampler = sample();
  // a fast machine may train a short run's only round between two polls: its end counts as having seen it
  await until('a round', () => window.fedper.trainer.progress !== null || window.fedper.agent()?.finalAccuracy != null);
  await shot('mid-round');
  if (Number(reloadAfter) > 0) {
    result.reloadedAfter = await until(`the update of round ${reloadAfter}`, (k) => {
      const sent = window.fedper.agent()?.lastSent ?? 0; // sentRound resets at each RoundInfo: too brief to poll
      return sent >= k && sent;
    }, Number(reloadAfter));
    result.logBeforeReload = await page.evaluate(() => window.fedper.lines);
    sampling = false; // no script call in flight while the page navigates: WebKit's WebDriver may never answer it
    await sampler;
    await page.reload();
    await loads('the page to rejoin', () => window.fedper?.running());
    sampling = true;
    sampler = sample();
  }
  result.final = (await until('the run to finish', () => window.fedper.agent()?.finalAccuracy != null && { accuracy: window.fedper.agent().finalAccuracy })).accuracy;
  sampling = false;
  await sampler;
  // the status follows once the agent has said goodbye to the broker, a moment after the accuracy is known
  result.status = await until('the page to say finished', () => {
    const status = document.querySelector('#status').textContent;
    return status.startsWith('finished') && status;
  });
  await shot('end');
  result.log = await page.evaluate(() => window.fedper.lines);
  result.device = await page.evaluate(() => window.fedper.device);
} catch (e) {
  result.error = e.message;
  result.log ??= await page?.evaluate(() => window.fedper?.lines).catch(() => undefined); // what the page said last
} finally {
  sampling = false;
  await browser.close();
  console.log(JSON.stringify(result));
}
