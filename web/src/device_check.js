// Whether this device has the memory the export needs, said in one line before the person joins. The need is an
// estimate from the tab's measured peak while training (docs/performance.md, "The page in every engine": MobileNet-v1
// at widths 0.25, 0.5 and 1.0, 32x32, batch 32, the largest of chromium, firefox and WebKit), a straight line in the
// model's parameter count. navigator.deviceMemory (Chromium-based browsers, secure contexts) is the device's RAM in
// GB, rounded; a tab cannot count on more than a quarter of it (the system, other apps and the browser hold the rest).

const BASE_MB = 600; // the tab's peak for a model of no parameters: the fitted line's intercept (chromium's renderer)
const MB_PER_MILLION = 40; // and its slope, per million parameter values
const USABLE_SHARE = 0.25;

/** MB the tab is estimated to need to train this export. */
export function neededMB(manifest) {
  return Math.round(BASE_MB + (MB_PER_MILLION * manifest.parameterCount) / 1e6);
}

/** One line: the estimate against `deviceMemory` (navigator.deviceMemory: GB, or undefined where the engine has none). */
export function memoryLine(manifest, deviceMemory) {
  const need = `training this model takes about ${neededMB(manifest)} MB in this tab`;
  if (!(deviceMemory > 0)) return `${need}; this browser does not say how much memory the device has`;
  const usable = deviceMemory * 1000 * USABLE_SHARE;
  return neededMB(manifest) <= usable
    ? `${need}; this device has about ${deviceMemory} GB: enough`
    : `${need}; this device has about ${deviceMemory} GB: it may run out of memory (close other apps and tabs, or ask for a smaller model)`;
}
