// Images into the model's input exactly as the Python agent makes them (fedper/data/sources.py): RGB resized to
// the manifest's input size with Pillow's bilinear resampling (Image.resize, Resampling.BILINEAR: a triangle
// filter widened by the scale when shrinking, 22-bit fixed-point weights, a horizontal pass then a vertical one,
// each rounded to 8 bits), then (x / 255 - mean) / std per channel through float32 lookup tables. A canvas's own
// scaling differs between browsers and from Pillow, so the page resizes here.

const PRECISION_BITS = 22;

/** Pillow's precompute_coeffs + normalize_coeffs_8bpc for one axis: per output pixel [first input, weights]. */
function coefficients(inSize, outSize) {
  const scale = inSize / outSize;
  const filterscale = Math.max(scale, 1);
  const support = filterscale; // the bilinear filter's support, 1, times the scale
  const out = [];
  for (let xx = 0; xx < outSize; xx++) {
    const center = (xx + 0.5) * scale;
    const xmin = Math.max(0, Math.trunc(center - support + 0.5));
    const xmax = Math.min(inSize, Math.trunc(center + support + 0.5)) - xmin;
    const weights = [];
    let total = 0;
    for (let x = 0; x < xmax; x++) {
      const w = Math.max(0, 1 - Math.abs((x + xmin - center + 0.5) / filterscale));
      weights.push(w);
      total += w;
    }
    out.push([xmin, weights.map((w) => Math.trunc(0.5 + (total !== 0 ? w / total : w) * (1 << PRECISION_BITS)))]);
  }
  return out;
}

const clip8 = (v) => (v >= 2 ** (PRECISION_BITS + 8) ? 255 : v <= 0 ? 0 : Math.floor(v / 2 ** PRECISION_BITS));

/** RGB bytes (height x width x 3, row-major) resized to outHeight x outWidth as Pillow's BILINEAR resize does. */
export function resizeBilinear(rgb, width, height, outWidth, outHeight) {
  if (width === outWidth && height === outHeight) return rgb.slice(); // Pillow returns a copy, unfiltered
  const needH = outWidth !== width, needV = outHeight !== height;
  const horizontal = coefficients(width, outWidth), vertical = coefficients(height, outHeight);
  let src = rgb, w = width, firstRow = 0;
  if (needH) {
    // only the rows the vertical pass reads (Pillow's ybox_first .. ybox_last)
    firstRow = needV ? vertical[0][0] : 0;
    const lastRow = needV ? vertical.at(-1)[0] + vertical.at(-1)[1].length : height;
    const rows = lastRow - firstRow;
    const tmp = new Uint8Array(rows * outWidth * 3);
    for (let y = 0; y < rows; y++) {
      for (let xx = 0; xx < outWidth; xx++) {
        const [xmin, k] = horizontal[xx];
        for (let c = 0; c < 3; c++) {
          let ss = 1 << (PRECISION_BITS - 1);
          for (let x = 0; x < k.length; x++) ss += src[((y + firstRow) * width + x + xmin) * 3 + c] * k[x];
          tmp[(y * outWidth + xx) * 3 + c] = clip8(ss);
        }
      }
    }
    src = tmp;
    w = outWidth;
  }
  if (!needV) return src;
  const out = new Uint8Array(outHeight * w * 3);
  for (let yy = 0; yy < outHeight; yy++) {
    const [ymin, k] = vertical[yy];
    const base = ymin - (needH ? firstRow : 0);
    for (let x = 0; x < w * 3; x++) {
      let ss = 1 << (PRECISION_BITS - 1);
      for (let y = 0; y < k.length; y++) ss += src[(y + base) * w * 3 + x] * k[y];
      out[yy * w * 3 + x] = clip8(ss);
    }
  }
  return out;
}

/** fedper.data.to_float_nchw: uint8 NHWC images (n of them, each h x w x 3) -> float32 NCHW, normalized through a
 * 256-entry float32 table per channel computed in float64. */
export function toFloatNCHW(images, n, height, width, mean, std) {
  const luts = [0, 1, 2].map((c) => Float32Array.from({ length: 256 }, (_, i) => (i / 255 - mean[c]) / std[c]));
  const plane = height * width;
  const out = new Float32Array(n * 3 * plane);
  for (let i = 0; i < n; i++) {
    for (let p = 0; p < plane; p++) {
      for (let c = 0; c < 3; c++) out[(i * 3 + c) * plane + p] = luts[c][images[(i * plane + p) * 3 + c]];
    }
  }
  return out;
}
