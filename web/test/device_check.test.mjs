// The page's memory line: the estimate covers every tab peak docs/performance.md measured (engine, width, parameter
// values, MB, read from its table), and the line says enough, too little or unknown as navigator.deviceMemory says.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'node:test';

import { memoryLine, neededMB } from '../src/device_check.js';
import { REPO } from './helpers.mjs';

/** The rows of docs/performance.md's per-engine table: [engine, width, parameter values, tab peak MB]. */
function measured() {
  const text = readFileSync(join(REPO, 'docs', 'performance.md'), 'utf8');
  const rows = [...text.matchAll(/^\| (chromium|firefox|webkit) \| ([\d.]+) \| ([\d,]+) \| .* \| (\d+) \|$/gm)];
  return rows.map((m) => [m[1], Number(m[2]), Number(m[3].replaceAll(',', '')), Number(m[4])]);
}

test('the estimate is at least every tab peak measured, and within 1.5x of the largest', () => {
  const rows = measured();
  assert.equal(rows.length, 9, 'three engines at three widths');
  for (const [engine, width, params, peak] of rows) {
    assert.ok(neededMB({ parameterCount: params }) >= peak, `${engine} at width ${width}: ${peak} MB measured`);
  }
  for (const params of new Set(rows.map((r) => r[2]))) {
    const largest = Math.max(...rows.filter((r) => r[2] === params).map((r) => r[3]));
    assert.ok(neededMB({ parameterCount: params }) <= 1.5 * largest, `${params} values: ${largest} MB measured`);
  }
});

test('the line says whether the device has enough, or that the browser does not say', () => {
  const manifest = { parameterCount: 3_228_010 };
  const need = neededMB(manifest);
  assert.match(memoryLine(manifest, undefined), new RegExp(`about ${need} MB in this tab; this browser does not say`));
  assert.match(memoryLine(manifest, 8), /this device has about 8 GB: enough$/);
  assert.match(memoryLine(manifest, 0.5), /this device has about 0.5 GB: it may run out of memory/);
  // a tab counts on a quarter of the device's memory: the boundary in GB, from the estimate
  const boundary = (4 * need) / 1000;
  assert.match(memoryLine(manifest, boundary), /enough$/);
  assert.match(memoryLine(manifest, boundary * 0.99), /may run out/);
});
