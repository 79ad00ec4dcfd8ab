// The page's chance line says what the Python agent's says for the same test labels (fedper.data.chance_words).
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { chanceWords } from '../src/chance.js';
import { python } from './helpers.mjs';

const CASES = [[0, 0, 1, 2], [3, 3, 3, 1], [0, 1, 2, 3, 4, 5, 6, 7], [2, 2, 2, 2, 2, 2, 2, 5], [1], [],
  [0, 1, 1, 2, 2, 2, 0, 1, 9, 9, 9, 9, 9, 9, 9, 9]];

test('the page words its chance line as the Python agent does', () => {
  const theirs = JSON.parse(python(`
import json, sys
from fedper.data import chance_words
print(json.dumps([chance_words(c) for c in json.loads(sys.argv[1])]))`, JSON.stringify(CASES)));
  assert.deepEqual(CASES.map(chanceWords), theirs);
  assert.equal(chanceWords([0, 0, 1, 2]), '3 classes: guessing the most frequent gives 50 %');
});
