/** A device's chance line in words, to stand beside every accuracy a person reads on the page: its test classes,
 * and the accuracy of always answering the most frequent one (the Python agent's rule, fedper.data.chance_words:
 * 1/k when the classes are balanced). Percent rounded half to even, as Python's format does. */
export function chanceWords(labels) {
  if (!labels.length) return 'no test images: no chance line';
  const counts = new Map();
  for (const y of labels) counts.set(y, (counts.get(y) ?? 0) + 1);
  const k = counts.size;
  const percent = (100 * Math.max(...counts.values())) / labels.length;
  return `${k} class${k === 1 ? '' : 'es'}: guessing the most frequent gives ${roundHalfEven(percent)} %`;
}

function roundHalfEven(x) {
  const floor = Math.floor(x);
  const rest = x - floor;
  if (rest !== 0.5) return Math.round(x);
  return floor % 2 === 0 ? floor : floor + 1;
}
