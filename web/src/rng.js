// numpy's default_rng(seed).permutation(n), bit for bit, and the toolkit's two uses of it: the batch order
// (fedper/batches.py epoch_batches) and the fixed train/test split (fedper/data/partition.py split_train_test).
// The page draws the same batches as fedper-agent from the same seed, so the two train alike (parity).
// numpy: SeedSequence (numpy/random/bit_generator.pyx), PCG64 (XSL-RR 128/64), Generator.shuffle's bounded draws.

const MASK32 = 0xffffffff;
const MASK64 = (1n << 64n) - 1n;
const MASK128 = (1n << 128n) - 1n;
const PCG_MULTIPLIER = (2549297995355413924n << 64n) + 4865540595714422341n;

/** SeedSequence(entropy).generate_state(words, uint32): entropy is a list of non-negative integers. */
export function seedSequenceState(entropy, words) {
  const INIT_A = 0x43b0d7e5, MULT_A = 0x931e8875, INIT_B = 0x8b51f9dd, MULT_B = 0x58f38ded;
  const MIX_L = 0xca01f9dd, MIX_R = 0x4973f715, POOL = 4;
  const data = [];
  for (const value of entropy) { // each integer as uint32 words, least significant first (0 is one word)
    let v = BigInt(value);
    if (v < 0n) throw new RangeError('seeds are non-negative integers');
    do { data.push(Number(v & 0xffffffffn)); v >>= 32n; } while (v > 0n);
  }
  let hashConst = INIT_A;
  const hashmix = (value) => {
    value = (value ^ hashConst) >>> 0;
    hashConst = Math.imul(hashConst, MULT_A) >>> 0;
    value = Math.imul(value, hashConst) >>> 0;
    return (value ^ (value >>> 16)) >>> 0;
  };
  const mix = (x, y) => {
    const r = (Math.imul(MIX_L, x) - Math.imul(MIX_R, y)) >>> 0;
    return (r ^ (r >>> 16)) >>> 0;
  };
  const pool = [];
  for (let i = 0; i < POOL; i++) pool.push(hashmix(i < data.length ? data[i] : 0));
  for (let src = 0; src < POOL; src++) {
    for (let dst = 0; dst < POOL; dst++) if (src !== dst) pool[dst] = mix(pool[dst], hashmix(pool[src]));
  }
  for (let src = POOL; src < data.length; src++) {
    for (let dst = 0; dst < POOL; dst++) pool[dst] = mix(pool[dst], hashmix(data[src]));
  }
  const out = [];
  let h = INIT_B;
  for (let i = 0; i < words; i++) {
    let v = (pool[i % POOL] ^ h) >>> 0;
    h = Math.imul(h, MULT_B) >>> 0;
    v = Math.imul(v, h) >>> 0;
    out.push((v ^ (v >>> 16)) >>> 0);
  }
  return out;
}

/** numpy's PCG64 seeded as default_rng(entropy) seeds it. */
export class PCG64 {
  constructor(entropy) {
    const w = seedSequenceState(Array.isArray(entropy) ? entropy : [entropy], 8).map(BigInt);
    const u64 = (i) => (w[2 * i + 1] << 32n) | w[2 * i]; // generate_state(4, uint64): little-endian word pairs
    const seed = (u64(0) << 64n) | u64(1);
    this.inc = (((u64(2) << 64n) | u64(3)) << 1n | 1n) & MASK128;
    this.state = 0n;
    this.step();
    this.state = (this.state + seed) & MASK128;
    this.step();
    this.spare = null; // PCG64's buffered upper half for 32-bit draws
  }

  step() {
    this.state = (this.state * PCG_MULTIPLIER + this.inc) & MASK128;
  }

  next64() {
    this.step();
    const hi = this.state >> 64n, lo = this.state & MASK64, rot = Number(this.state >> 122n);
    const x = hi ^ lo;
    return ((x >> BigInt(rot)) | (x << BigInt((64 - rot) & 63))) & MASK64;
  }

  next32() {
    if (this.spare !== null) {
      const v = this.spare;
      this.spare = null;
      return v;
    }
    const v = this.next64();
    this.spare = Number(v >> 32n);
    return Number(v & 0xffffffffn);
  }

  /** A uniform integer in [0, max] by masked rejection (numpy's random_interval). */
  interval(max) {
    if (max === 0) return 0;
    if (max > MASK32) throw new RangeError('interval above 2^32 - 1 is not needed here');
    let mask = max;
    for (const s of [1, 2, 4, 8, 16]) mask |= mask >>> s;
    mask >>>= 0;
    let v;
    do { v = (this.next32() & mask) >>> 0; } while (v > max);
    return v;
  }

  /** default_rng(...).permutation(n) for n >= 0, or of the given array. */
  permutation(values) {
    const a = typeof values === 'number' ? Array.from({ length: values }, (_, i) => i) : [...values];
    for (let i = a.length - 1; i > 0; i--) {
      const j = this.interval(i);
      [a[i], a[j]] = [a[j], a[i]];
    }
    return a;
  }
}

/** fedper.batches.epoch_batches: default_rng(seed).permutation(n) cut into batch_size pieces; a lone last sample
 * joins the batch before it (BatchNorm in train mode needs two). */
export function epochBatches(n, batchSize, seed) {
  if (n < 1 || batchSize < 1) throw new RangeError(`need a sample and a batch size >= 1, got n=${n}, ${batchSize}`);
  const perm = new PCG64(seed).permutation(n);
  const batches = [];
  for (let i = 0; i < n; i += batchSize) batches.push(perm.slice(i, i + batchSize));
  if (batches.length > 1 && batches.at(-1).length === 1) batches.splice(-2, 2, [...batches.at(-2), ...batches.at(-1)]);
  return batches;
}

/** fedper.data.partition._test_counts: test samples per class, stratified, >= 1 on each side when a class has 2+. */
export function testCounts(counts, fraction) {
  const round9 = (v) => Math.round(v * 1e9) / 1e9; // np.round(v, 9) up to ties, which counts * 0.2 never hits
  const quota = counts.map((c) => round9(c * fraction));
  const lo = counts.map((c, i) => Math.max(Math.floor(quota[i]), c >= 2 ? 1 : 0));
  const hi = counts.map((c, i) => Math.min(Math.ceil(quota[i]), Math.max(c - 1, 0)));
  const target = Math.floor(quota.reduce((a, b) => a + b, 0) + 0.5);
  const canGrow = counts.map((_, i) => i).filter((i) => hi[i] > lo[i]);
  canGrow.sort((a, b) => (lo[a] - quota[a]) - (lo[b] - quota[b]) || a - b); // stable argsort
  const n = [...lo];
  const extra = Math.max(0, target - lo.reduce((a, b) => a + b, 0));
  for (const i of canGrow.slice(0, extra)) n[i] += 1;
  return n;
}

/** split_train_test([arange(n)], labels, fraction, seed) for one device: {train, test} index arrays. */
export function splitTrainTest(labels, fraction, seed) {
  const rng = new PCG64(seed);
  const classes = [...new Set(labels)].sort((a, b) => a - b);
  const counts = classes.map((c) => labels.filter((y) => y === c).length);
  const nTest = testCounts(counts, fraction);
  const train = [], test = [];
  classes.forEach((c, k) => {
    const members = rng.permutation(labels.flatMap((y, i) => (y === c ? [i] : [])));
    test.push(...members.slice(0, nTest[k]));
    train.push(...members.slice(nTest[k]));
  });
  const ascending = (a, b) => a - b; // partition._concat sorts
  return { train: train.sort(ascending), test: test.sort(ascending) };
}
