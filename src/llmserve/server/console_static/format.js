// Numbers for people.

export function number(x, digits = 1) {
  if (x === null || x === undefined || !Number.isFinite(x)) return "–";
  return x.toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: 0 });
}

export function integer(x) {
  return number(x, 0);
}

export function bytes(n) {
  if (n === null || n === undefined || !Number.isFinite(n)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${number(n, i ? 1 : 0)} ${units[i]}`;
}

export function count(n) {
  if (n === null || n === undefined || !Number.isFinite(n)) return "–";
  if (n >= 1e9) return `${number(n / 1e9, 2)} B`;
  if (n >= 1e6) return `${number(n / 1e6, 1)} M`;
  if (n >= 1e3) return `${number(n / 1e3, 1)} K`;
  return integer(n);
}

export function millis(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "–";
  return seconds >= 10 ? `${number(seconds, 1)} s` : `${number(seconds * 1000, 0)} ms`;
}

export function percent(fraction) {
  if (fraction === null || fraction === undefined || !Number.isFinite(fraction)) return "–";
  return `${number(fraction * 100, 1)} %`;
}

export function dollars(x) {
  if (x === null || x === undefined || !Number.isFinite(x)) return "–";
  return `$${x < 0.01 ? x.toPrecision(2) : number(x, 4)}`;
}
