// The live dashboard: reads /metrics every second, derives rates and percentiles from the
// counters and histograms, and plots the last five minutes with uPlot.

import { getText } from "./api.js";
import * as fmt from "./format.js";
import { byLabel, histogramDelta, parse, quantile, total } from "./prom.js";

const P = "llmserve:";
const POLL_MS = 1000;
const HISTORY_S = 300;
const RATE_WINDOW_S = 5;
const PERCENTILE_WINDOW_S = 10;

// What one reading of /metrics adds to the plots, against the readings before it.
function derive(now, rateBase, pctBase, costPerHour) {
  const m = now.samples;
  const rate = (name) => {
    if (!rateBase) return null;
    const d = total(m, name) - total(rateBase.samples, name);
    return d >= 0 ? d / (now.t - rateBase.t) : null; // a restarted server counts from 0
  };
  const pct = (name, q) => {
    if (!pctBase) return null;
    const h = histogramDelta(m, pctBase.samples, name);
    return h.count > 0 ? quantile(q, h.buckets) : null;
  };
  const mean = (name) => {
    if (!rateBase) return null;
    const h = histogramDelta(m, rateBase.samples, name);
    return h.count > 0 ? h.sum / h.count : null;
  };
  const output = rate(`${P}generation_tokens_total`);
  const queries = rateBase ? total(m, `${P}prefix_cache_queries_total`)
    - total(rateBase.samples, `${P}prefix_cache_queries_total`) : 0;
  const hits = rateBase ? total(m, `${P}prefix_cache_hits_total`)
    - total(rateBase.samples, `${P}prefix_cache_hits_total`) : 0;
  const drafted = rateBase ? total(m, `${P}spec_decode_num_draft_tokens_total`)
    - total(rateBase.samples, `${P}spec_decode_num_draft_tokens_total`) : 0;
  const accepted = rateBase ? total(m, `${P}spec_decode_num_accepted_tokens_total`)
    - total(rateBase.samples, `${P}spec_decode_num_accepted_tokens_total`) : 0;
  const errors = {};
  if (rateBase) {
    const before = byLabel(rateBase.samples, `${P}http_responses_total`, "status");
    const after = byLabel(m, `${P}http_responses_total`, "status");
    for (const [status, n] of Object.entries(after)) {
      if (Number(status) < 400) continue;
      const d = n - (before[status] || 0);
      if (d >= 0) errors[status] = d / (now.t - rateBase.t);
    }
  }
  return {
    t: now.t,
    wall: now.wall,
    output,
    prompt: rate(`${P}prompt_tokens_total`),
    ttft50: pct(`${P}time_to_first_token_seconds`, 0.5),
    ttft99: pct(`${P}time_to_first_token_seconds`, 0.99),
    itl50: pct(`${P}inter_token_latency_seconds`, 0.5),
    itl99: pct(`${P}inter_token_latency_seconds`, 0.99),
    running: total(m, `${P}num_requests_running`),
    waiting: total(m, `${P}num_requests_waiting`),
    kv: total(m, `${P}kv_cache_usage_perc`),
    hitRate: queries > 0 ? hits / queries : null,
    hitRateAll: total(m, `${P}prefix_cache_queries_total`) > 0
      ? total(m, `${P}prefix_cache_hits_total`) / total(m, `${P}prefix_cache_queries_total`) : null,
    acceptance: drafted > 0 ? accepted / drafted : null,
    errors,
    batch: mean(`${P}iteration_batch_size`),
    batch90: pct(`${P}iteration_batch_size`, 0.9),
    stepTokens: mean(`${P}iteration_tokens_total`),
    steps: rate(`${P}iteration_batch_size_count`),
    cost: costPerHour && output > 0 ? (costPerHour / 3600 / output) * 1000 : null,
  };
}

const ms = (x) => (x === null ? null : x * 1000);
const pctOf = (x) => (x === null ? null : x * 100);

// Each chart: its title, and its series as [label, value of a derived point].
const CHARTS = [
  { id: "tokens", title: "Tokens per second",
    series: [["output", (p) => p.output], ["prompt", (p) => p.prompt]] },
  { id: "ttft", title: "Time to first token (ms)",
    series: [["p50", (p) => ms(p.ttft50)], ["p99", (p) => ms(p.ttft99)]] },
  { id: "itl", title: "Inter-token latency (ms)",
    series: [["p50", (p) => ms(p.itl50)], ["p99", (p) => ms(p.itl99)]] },
  { id: "requests", title: "Requests",
    series: [["running", (p) => p.running], ["waiting", (p) => p.waiting]] },
  { id: "cache", title: "KV cache usage and prefix-cache hit rate (%)",
    series: [["KV used", (p) => pctOf(p.kv)], ["prefix hits", (p) => pctOf(p.hitRate)]] },
  { id: "batch", title: "Sequences in each engine step",
    series: [["mean", (p) => p.batch], ["p90", (p) => p.batch90]] },
  { id: "errors", title: "Error responses per second, by status", series: null },
  { id: "cost", title: "Cost per 1K output tokens ($)", series: [["cost", (p) => p.cost]] },
];

const TILES = [
  ["output-tps", "Output tokens/s", (p) => fmt.number(p.output)],
  ["ttft-p50", "TTFT p50", (p) => fmt.millis(p.ttft50)],
  ["itl-p50", "ITL p50", (p) => fmt.millis(p.itl50)],
  ["running", "Running", (p) => fmt.integer(p.running)],
  ["waiting", "Waiting", (p) => fmt.integer(p.waiting)],
  ["kv", "KV cache used", (p) => fmt.percent(p.kv)],
  ["prefix-hits", "Prefix-cache hits (all time)", (p) => fmt.percent(p.hitRateAll)],
  ["batch", "Sequences/step", (p) => fmt.number(p.batch)],
  ["step-tokens", "Tokens/step", (p) => fmt.number(p.stepTokens)],
  ["steps", "Engine steps/s", (p) => fmt.number(p.steps)],
  ["cost", "Cost per 1K output tokens", (p, d) => (d.costPerHour ? fmt.dollars(p.cost)
    : "not set")],
  ["acceptance", "Draft tokens accepted", (p) => fmt.percent(p.acceptance)],
];

const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#be185d"];

export class Dashboard {
  constructor({ charts, tiles, status, outage }) {
    this.chartsEl = charts;
    this.tilesEl = tiles;
    this.statusEl = status;
    this.outageEl = outage; // shown while /metrics does not answer
    this.outageSince = null;
    this.readings = []; // {t, samples}, the last PERCENTILE_WINDOW_S and a little more
    this.points = []; // derived, the last HISTORY_S
    this.charts = new Map(); // id -> {plot, el, key}
    this.visible = false;
    this.costPerHour = null;
    this.timer = null;
    this.polling = false;
    this.speculative = false;
    this.tiles = new Map();
    for (const [id, label] of TILES) {
      const tile = document.createElement("div");
      tile.className = "tile";
      tile.dataset.metric = id;
      const value = document.createElement("span");
      value.className = "tile-value";
      value.textContent = "–";
      const name = document.createElement("span");
      name.className = "tile-label";
      name.textContent = label;
      tile.append(value, name);
      this.tilesEl.append(tile);
      this.tiles.set(id, value);
    }
    this.observer = new ResizeObserver(() => this.resize());
    this.observer.observe(this.chartsEl);
  }

  setInfo(info) {
    this.costPerHour = info.cost_per_hour || null;
    this.speculative = Boolean(info.speculative);
    this.tiles.get("acceptance").parentElement.hidden = !this.speculative;
  }

  start() {
    if (this.timer === null) {
      this.poll();
      this.timer = setInterval(() => {
        // One reading at a time (a slow /metrics must not pile up requests that starve
        // the chat of connections), and none while the browser tab is hidden.
        if (!this.polling && !document.hidden) this.poll();
      }, POLL_MS);
    }
  }

  stop() {
    clearInterval(this.timer);
    this.timer = null;
  }

  show() {
    this.visible = true;
    this.render();
    this.resize();
  }

  hide() {
    this.visible = false;
  }

  baseFor(t, window) {
    // The newest reading at least `window` seconds old, else the oldest there is.
    let base = null;
    for (const r of this.readings) {
      if (t - r.t >= window - 0.25) base = r;
      else break;
    }
    return base || (this.readings.length ? this.readings[0] : null);
  }

  async poll() {
    let text;
    this.polling = true;
    try {
      text = await getText("metrics");
    } catch (e) {
      this.markOutage(e);
      return;
    } finally {
      this.polling = false;
    }
    if (this.outageSince !== null) { // back: the rates start again from this reading
      this.outageSince = null;
      this.readings = [];
      this.outageEl.hidden = true;
      this.tilesEl.classList.remove("stale");
    }
    // t: seconds on a clock that never jumps (rates); wall: what the plot's axis shows.
    const now = { t: performance.now() / 1000, wall: Date.now() / 1000, samples: parse(text) };
    const point = derive(now, this.baseFor(now.t, RATE_WINDOW_S),
      this.baseFor(now.t, PERCENTILE_WINDOW_S), this.costPerHour);
    this.readings.push(now);
    while (this.readings.length && now.t - this.readings[0].t > PERCENTILE_WINDOW_S + 2) {
      this.readings.shift();
    }
    this.points.push(point);
    while (this.points.length && now.t - this.points[0].t > HISTORY_S) this.points.shift();
    this.statusEl.textContent = `Updated ${new Date(now.wall * 1000).toLocaleTimeString()}.`;
    for (const [id, , value] of TILES) {
      const el = this.tiles.get(id);
      el.textContent = value(point, this);
    }
    if (this.visible) this.render();
  }

  // No reading: the tiles keep the last figures, greyed and said to be old, and the charts
  // get a gap rather than a line drawn across the outage.
  markOutage(error) {
    if (this.outageSince === null) {
      this.outageSince = new Date();
      this.points.push({ t: performance.now() / 1000, wall: Date.now() / 1000, gap: true });
      if (this.visible) this.render();
    }
    this.tilesEl.classList.add("stale");
    this.outageEl.hidden = false;
    this.outageEl.textContent = "No metrics since "
      + `${this.outageSince.toLocaleTimeString()}: ${error.message}. The figures below are `
      + "the last the server gave.";
  }

  seriesOf(chart) {
    if (chart.series) return chart.series;
    const statuses = new Set();
    for (const p of this.points) for (const s of Object.keys(p.errors || {})) statuses.add(s);
    const sorted = [...statuses].sort();
    const all = ["all errors", (p) => Object.values(p.errors).reduce((a, b) => a + b, 0)];
    return [all, ...sorted.map((s) => [s, (p) => p.errors[s] ?? 0])];
  }

  render() {
    if (!this.visible || typeof uPlot === "undefined") return;
    const xs = this.points.map((p) => p.wall);
    for (const chart of CHARTS) {
      const series = this.seriesOf(chart);
      const key = series.map(([label]) => label).join("|");
      const data = [xs, ...series.map(([, value]) => this.points.map(
        (p) => (p.gap ? null : value(p))))];
      let entry = this.charts.get(chart.id);
      if (entry && entry.key !== key) {
        entry.plot.destroy();
        entry.el.remove();
        entry = null;
      }
      if (!entry) entry = this.create(chart, series, key, data);
      else entry.plot.setData(data);
      entry.el.dataset.points = String(data[1].filter((v) => v !== null).length);
    }
  }

  create(chart, series, key, data) {
    let el = this.chartsEl.querySelector(`[data-chart="${chart.id}"]`);
    if (!el) {
      el = document.createElement("figure");
      el.className = "chart";
      el.dataset.chart = chart.id;
      el.setAttribute("aria-label", chart.title);
      const order = CHARTS.findIndex((c) => c.id === chart.id);
      const next = [...this.chartsEl.children].find(
        (c) => CHARTS.findIndex((x) => x.id === c.dataset.chart) > order);
      this.chartsEl.insertBefore(el, next || null);
    }
    el.replaceChildren();
    const style = getComputedStyle(document.body);
    const ink = style.getPropertyValue("--ink").trim() || "#222";
    const grid = style.getPropertyValue("--grid").trim() || "#ddd";
    const axis = { stroke: ink, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid } };
    const plot = new uPlot({
      title: chart.title,
      width: widthOf(el),
      height: 190,
      scales: { x: { time: true }, y: { range: (u, min, max) => [Math.min(0, min), max > 0 ? max * 1.1 : 1] } },
      axes: [{ ...axis, space: 70, values: (u, splits) => splits.map(clock) },
        { ...axis, size: 56, values: (u, splits) => splits.map(tick) }],
      series: [{}, ...series.map(([label], i) => ({
        label, stroke: PALETTE[i % PALETTE.length], width: 2, spanGaps: false,
      }))],
      legend: { live: false },
    }, data, el);
    const entry = { plot, el, key };
    this.charts.set(chart.id, entry);
    return entry;
  }

  resize() {
    if (!this.visible) return;
    for (const { plot, el } of this.charts.values()) {
      const width = widthOf(el);
      if (plot.width !== width) plot.setSize({ width, height: 190 });
    }
  }
}

// Tick labels with three significant digits (costs are fractions of a cent).
function tick(v) {
  if (v === null || v === undefined) return "";
  if (Math.abs(v) >= 1000) return fmt.count(v);
  return String(Number(v.toPrecision(3)));
}

// Time ticks as the clock reads (uPlot's default adds the date at some ticks, and the
// labels then overlap).
function clock(v) {
  return new Date(v * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit",
    second: "2-digit" });
}

// The plot fills its grid cell (less the figure's padding).
function widthOf(figure) {
  return Math.max(200, figure.clientWidth - 8);
}
