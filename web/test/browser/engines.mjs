// The browser engines the page is tested in, each as a puppeteer-like `browser` with `newPage()` and `close()`:
// Debian's chromium (puppeteer-core over CDP), firefox-esr (puppeteer-core over WebDriver BiDi, no geckodriver) and
// WebKitGTK's MiniBrowser (webkit2gtk-driver's WebKitWebDriver over classic WebDriver, on an Xvfb display of its own
// when there is none). A WebKit page has the calls the drivers use (goto, reload, evaluate, $eval, select, click,
// $(...).uploadFile, screenshot, setViewport) and no console: classic WebDriver reports none.
// ENGINE=chromium|firefox|webkit picks one; CHROMIUM, FIREFOX and WEBKIT_DRIVER override the executables.

import { spawn } from 'node:child_process';
import { writeFile } from 'node:fs/promises';
import { createServer } from 'node:net';
import puppeteer from 'puppeteer-core';

export const ENGINE = process.env.ENGINE ?? 'chromium';

/** The engine's browser; `timeoutS` bounds one call into the page. */
export async function launch(engine, timeoutS) {
  if (engine === 'chromium') {
    return puppeteer.launch({
      executablePath: process.env.CHROMIUM ?? '/usr/bin/chromium', headless: true,
      args: ['--no-sandbox', '--disable-dev-shm-usage', '--host-resolver-rules=MAP phone.test 127.0.0.1'], protocolTimeout: timeoutS * 1000,
    });
  }
  if (engine === 'firefox') {
    return puppeteer.launch({ browser: 'firefox', executablePath: process.env.FIREFOX ?? '/usr/bin/firefox-esr', headless: true, protocolTimeout: timeoutS * 1000 });
  }
  if (engine === 'webkit') return WebKit.launch(timeoutS);
  throw new Error(`unknown engine ${engine}: chromium, firefox or webkit`);
}

const freePort = () => new Promise((resolve) => {
  const server = createServer().listen(0, '127.0.0.1', () => {
    const { port } = server.address();
    server.close(() => resolve(port));
  });
});

/** An X display for MiniBrowser: $DISPLAY, else an Xvfb started here (it names its display on fd 3). */
async function display(children) {
  if (process.env.DISPLAY) return process.env.DISPLAY;
  const xvfb = spawn('Xvfb', ['-displayfd', '3', '-screen', '0', '1280x1024x24', '-nolisten', 'tcp'], { stdio: ['ignore', 'ignore', 'ignore', 'pipe'] });
  children.push(xvfb);
  const number = await new Promise((resolve, reject) => {
    xvfb.on('error', reject);
    xvfb.stdio[3].on('data', (d) => resolve(String(d).trim()));
  });
  return `:${number}`;
}

const ELEMENT = 'element-6066-11e4-a52e-4f735466cecf';

class WebKit {
  static async launch(timeoutS) {
    const children = [];
    const port = await freePort();
    const env = { ...process.env, DISPLAY: await display(children) };
    const driver = spawn(process.env.WEBKIT_DRIVER ?? 'WebKitWebDriver', [`--port=${port}`], { env, stdio: 'ignore' });
    children.push(driver);
    const browser = new WebKit(`http://127.0.0.1:${port}`, children);
    for (let tries = 0; ; tries++) { // the driver listens within a second
      try {
        browser.session = (await browser.call('POST', '/session', { capabilities: {} })).sessionId;
        break;
      } catch (e) {
        if (tries > 40) throw e;
        await new Promise((r) => setTimeout(r, 250));
      }
    }
    await browser.call('POST', `/session/${browser.session}/timeouts`, { script: timeoutS * 1000, pageLoad: timeoutS * 1000 });
    return browser;
  }

  constructor(base, children) {
    this.base = base;
    this.children = children;
  }

  process() {
    return this.children.at(-1);
  }

  async call(method, path, body) {
    const response = await fetch(this.base + path, { method, body: body && JSON.stringify(body), headers: { 'content-type': 'application/json' } });
    const { value } = await response.json();
    if (!response.ok) throw new Error(`WebKitWebDriver ${path}: ${value?.message ?? response.status}`);
    return value;
  }

  async newPage() {
    return new WebKitPage(this, `/session/${this.session}`);
  }

  async close() {
    await this.call('DELETE', `/session/${this.session}`).catch(() => {});
    for (const child of this.children.reverse()) child.kill();
  }
}

class WebKitPage {
  constructor(browser, session) {
    this.browser = browser;
    this.session = session;
  }

  call(method, path, body) {
    return this.browser.call(method, this.session + path, body);
  }

  on() {} // no console over classic WebDriver

  setViewport({ width, height }) {
    return this.call('POST', '/window/rect', { width, height });
  }

  goto(url) {
    return this.call('POST', '/url', { url });
  }

  reload() {
    return this.call('POST', '/refresh', {});
  }

  /** `fn(...args)` in the page (awaited), as puppeteer's evaluate: the function goes as its source. */
  async evaluate(fn, ...args) {
    const script = `const done = arguments[2];
      Promise.resolve().then(() => new Function('return (' + arguments[0] + ')')()(...arguments[1]))
        .then((value) => done({ value: value === undefined ? null : value }), (e) => done({ error: String(e?.message ?? e) }));`;
    const { value, error } = await this.call('POST', '/execute/async', { script, args: [String(fn), args] });
    if (error !== undefined) throw new Error(error);
    return value;
  }

  $eval(selector, fn) {
    return this.evaluate(`(s) => (${fn})(document.querySelector(s))`, selector);
  }

  select(selector, value) {
    return this.$eval(selector, `(e) => { e.value = ${JSON.stringify(value)}; e.dispatchEvent(new Event('input', { bubbles: true })); e.dispatchEvent(new Event('change', { bubbles: true })); }`);
  }

  async $(selector) {
    const id = (await this.call('POST', '/element', { using: 'css selector', value: selector }))[ELEMENT];
    return {
      uploadFile: async (...files) => { // WebDriver adds files to a `multiple` input's; puppeteer replaces them
        await this.$eval(selector, "(e) => { e.value = ''; }"); // the one way to empty a file input
        await this.call('POST', `/element/${id}/value`, { text: files.join('\n') });
      },
      click: () => this.call('POST', `/element/${id}/click`, {}),
    };
  }

  async click(selector) {
    await (await this.$(selector)).click();
  }

  async screenshot({ path }) {
    await writeFile(path, Buffer.from(await this.call('GET', '/screenshot'), 'base64'));
  }
}

/** until(what, check, ...args): `check` run in the page every 250 ms until it gives something truthy (returned), or an
 * error naming `what` and the page's status at `deadline` (ms since the epoch). */
export function poller(page, deadline) {
  return async (what, check, ...args) => {
    while (Date.now() < deadline) {
      const value = await page.evaluate(check, ...args).catch(() => null);
      if (value) return value;
      await new Promise((r) => setTimeout(r, 250));
    }
    throw new Error(`timed out waiting for ${what}; status: ${await page.$eval('#status', (e) => e.textContent).catch(() => '?')}`);
  };
}
