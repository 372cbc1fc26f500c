// The Prometheus text format, read: samples by metric name, sums over label sets, and
// histogram quantiles computed the way PromQL's histogram_quantile does.

const LINE = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
const LABEL = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;

export function parse(text) {
  const samples = new Map();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = LINE.exec(line);
    if (!m) continue;
    const labels = {};
    if (m[2]) for (const [, k, v] of m[2].matchAll(LABEL)) labels[k] = v.replace(/\\(.)/g, "$1");
    const value = m[3] === "+Inf" ? Infinity : Number(m[3]);
    if (!samples.has(m[1])) samples.set(m[1], []);
    samples.get(m[1]).push({ labels, value });
  }
  return samples;
}

// The sum of a metric over the label sets that match `where` (absent: 0).
export function total(samples, name, where = {}) {
  let sum = 0;
  for (const s of samples.get(name) || []) {
    if (Object.entries(where).every(([k, v]) => s.labels[k] === v)) sum += s.value;
  }
  return sum;
}

// Values of a metric by one label, summed over the others: {labelValue: sum}.
export function byLabel(samples, name, label) {
  const out = {};
  for (const s of samples.get(name) || []) {
    const key = s.labels[label];
    if (key !== undefined) out[key] = (out[key] || 0) + s.value;
  }
  return out;
}

// A histogram's cumulative buckets [[le, count], ...] sorted by le, summed over label sets.
export function buckets(samples, name) {
  const byLe = byLabel(samples, `${name}_bucket`, "le");
  return Object.entries(byLe)
    .map(([le, count]) => [le === "+Inf" ? Infinity : Number(le), count])
    .sort((a, b) => a[0] - b[0]);
}

// What a histogram gained between two readings: buckets, sum and count.
export function histogramDelta(now, before, name) {
  const b = new Map(buckets(before, name));
  return {
    buckets: buckets(now, name).map(([le, c]) => [le, c - (b.get(le) || 0)]),
    sum: total(now, `${name}_sum`) - total(before, `${name}_sum`),
    count: total(now, `${name}_count`) - total(before, `${name}_count`),
  };
}

// PromQL's histogram_quantile over cumulative buckets: linear within the bucket that holds
// the rank; null without observations; the highest finite bound if it lands in +Inf.
export function quantile(q, cumulative) {
  if (!cumulative.length) return null;
  const count = cumulative[cumulative.length - 1][1];
  if (!(count > 0)) return null;
  const rank = q * count;
  let lowerBound = 0;
  let lowerCount = 0;
  for (const [le, c] of cumulative) {
    if (c >= rank) {
      if (le === Infinity) return lowerBound;
      if (c === lowerCount) return le;
      return lowerBound + (le - lowerBound) * ((rank - lowerCount) / (c - lowerCount));
    }
    lowerBound = le;
    lowerCount = c;
  }
  return lowerBound;
}
