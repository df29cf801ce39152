// shoal dashboard: the code of the four pages and of the offline report.
//
// Each page says which it is in <body data-page="...">. The charts are drawn by
// functions that take plain data (the shapes of the JSON API), so that the live
// pages and the offline report share them: a live page feeds them from the
// server-sent events of api/v1/events; the report (data-page="report") feeds them
// once from the JSON embedded in the page (the element #shoal-data, of type application/json).
//
// The page keeps at most MAX_TASKS task-stream records (the oldest go first). The
// charts that changed are redrawn together, at most once a second, and less often
// when drawing is slow (never more than about a twentieth of the page's time), whatever
// the rate of updates: a page left open costs the cluster's host little. Tasks narrower than a pixel that follow each other on one row with the
// same prefix are drawn as one rectangle (the picture is the same, the cost is
// bounded by the chart's width, not by the task rate); zooming in draws each.
// Every URL is relative, so the dashboard also works behind a path prefix.
// window.shoalDashboard exposes what the charts hold, for tests and for the curious.
(function () {
  "use strict";

  const MAX_TASKS = 20000;
  const DRAW_MS = 1000;
  const DRAW_COST_FACTOR = 19; // a drawing pass waits at least this many times as long as the last one took
  const RATE_WINDOW_S = 300;
  const GRAPH_REFRESH_MS = 2000;
  const TASK_REFRESH_MS = 2000;

  const PATHS = ["inproc", "shm", "tcp"];
  const PATH_NAMES = { inproc: "by reference", shm: "shared memory", tcp: "tcp" };
  const PATH_COLORS = { inproc: "#17becf", shm: "#9467bd", tcp: "#ff7f0e" };
  const ERROR_COLOR = "#d62728";
  const STATE_COLORS = { done: "#3ba272", processing: "#5470c6", waiting: "#c8ccd2", erred: ERROR_COLOR };
  const MEMORY_COLORS = { managed: "#5470c6", shm: "#9467bd", spilled: "#8d99ae", unmanaged: "#fac858" };

  // ------------------------------------------------------------------ helpers

  function el(tag, attrs, children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null) continue;
      if (k === "text") node.textContent = v;
      else if (k === "class") node.className = v;
      else node.setAttribute(k, v);
    }
    for (const c of children || []) node.append(c);
    return node;
  }

  function escapeHtml(text) {
    return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  }

  function formatBytes(n) {
    if (n === null || n === undefined || !isFinite(n)) return "\u2014";
    const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let i = 0;
    let v = Math.abs(n);
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    const text = i === 0 ? String(Math.round(v)) : v.toFixed(v < 10 ? 2 : v < 100 ? 1 : 0);
    return (n < 0 ? "-" : "") + text + " " + units[i];
  }

  function formatSeconds(s) {
    if (s === null || s === undefined || !isFinite(s)) return "\u2014";
    if (s < 1e-3) return (s * 1e6).toFixed(0) + " \u00b5s";
    if (s < 1) return (s * 1e3).toFixed(s < 0.01 ? 2 : 1) + " ms";
    if (s < 120) return s.toFixed(2) + " s";
    return (s / 60).toFixed(1) + " min";
  }

  function formatTime(epoch) {
    if (epoch === null || epoch === undefined) return "\u2014";
    // by hand: toLocaleTimeString is slow, and axis labels ask for many
    const d = new Date(epoch * 1000);
    const two = (n) => (n < 10 ? "0" : "") + n;
    return two(d.getHours()) + ":" + two(d.getMinutes()) + ":" + two(d.getSeconds()) + "." + String(d.getMilliseconds()).padStart(3, "0");
  }

  function plural(n, one, many) { return n + " " + (n === 1 ? one : many); }

  function taskLink(key) {
    return el("a", { href: "task?key=" + encodeURIComponent(key), class: "key", text: key });
  }

  // a stable colour per task prefix: a hue from a hash of the name (reds are kept for errors)
  const prefixColors = new Map();
  function prefixColor(prefix) {
    let c = prefixColors.get(prefix);
    if (c) return c;
    let h = 2166136261;
    for (let i = 0; i < prefix.length; i++) { h ^= prefix.charCodeAt(i); h = Math.imul(h, 16777619); }
    h >>>= 0;
    const hue = 30 + (h % 300);
    const light = 0.45 + ((h >>> 9) % 3) * 0.08;
    c = hslToHex(hue, 0.6, light);
    prefixColors.set(prefix, c);
    return c;
  }

  function hslToHex(h, s, l) {
    const a = s * Math.min(l, 1 - l);
    const f = (n) => {
      const k = (n + h / 30) % 12;
      const v = l - a * Math.max(-1, Math.min(k - 3, 9 - k, 1));
      return Math.round(v * 255).toString(16).padStart(2, "0");
    };
    return "#" + f(0) + f(8) + f(4);
  }

  async function getJSON(url) {
    const response = await fetch(url, { headers: { Accept: "application/json" } });
    let body = null;
    try { body = await response.json(); } catch (e) { body = null; }
    if (!response.ok) {
      const error = new Error((body && body.error) || response.status + " " + response.statusText);
      error.status = response.status;
      throw error;
    }
    return body;
  }

  function setConnection(text, cls) {
    const node = document.getElementById("connection");
    if (!node) return;
    node.textContent = text;
    node.className = "connection " + (cls || "");
  }

  // ------------------------------------------------------------------ charts

  const charts = {};

  function chart(id) {
    if (charts[id]) return charts[id];
    const node = document.getElementById(id);
    if (!node) return null;
    charts[id] = echarts.init(node, null, { renderer: "canvas" });
    return charts[id];
  }

  function fitHeight(id, rows, perRow, min, max) {
    const node = document.getElementById(id);
    const height = Math.max(min, Math.min(max, rows * perRow + 70)) + "px";
    if (node.style.height !== height) {
      node.style.height = height;
      if (charts[id]) charts[id].resize();
    }
  }

  window.addEventListener("resize", () => { for (const c of Object.values(charts)) c.resize(); });

  // ---- pacing: what changed is drawn in one pass, DRAW_MS after the last pass (or
  // sooner, ``soon``, for what the reader did), and never in more than about a twentieth
  // of the time: a pass waits DRAW_COST_FACTOR times as long as the last one took

  const frames = { dirty: new Map(), timer: null, last: 0, cost: 0, drawn: new Map() };

  // ``what``: a text that says what ``draw`` would show; the same as last time: nothing to draw
  function later(name, draw, soon, what) {
    if (what !== undefined) {
      if (frames.drawn.get(name) === what) return;
      frames.drawn.set(name, what);
    }
    frames.dirty.set(name, draw);
    if (frames.timer !== null) return;
    const gap = Math.max(soon ? 0 : DRAW_MS, DRAW_COST_FACTOR * frames.cost);
    frames.timer = setTimeout(drawPass, Math.max(0, gap - (performance.now() - frames.last)));
  }

  function drawPass() {
    frames.timer = null;
    const work = [...frames.dirty.values()];
    frames.dirty.clear();
    const began = performance.now();
    for (const draw of work) draw();
    frames.last = performance.now();
    frames.cost = frames.last - began;
  }

  const BASE = { animation: false, textStyle: { fontFamily: "inherit" } };

  // ---- the task stream: one row per worker thread, a rectangle per task, its inputs' transfers before it

  const stream = {
    records: [], next: 0, drawn: null, clickable: true, many: null,
    zoom: { start: 0, end: 100 }, // the part of the time axis in view (percent), as the reader zoomed
  };

  function addRecords(records) {
    const kept = stream.records;
    for (const r of records) {
      if (r.index < stream.next) continue; // seen already (the first update repeats the latest)
      r.row = rowName(r.worker, r.thread);
      kept.push(r);
      stream.next = r.index + 1;
    }
    if (kept.length > MAX_TASKS) kept.splice(0, kept.length - MAX_TASKS);
  }


  // Items [row, start, stop, record, count] (times in ms) with runs merged: on one row,
  // an item narrower than ``tick`` that starts within ``tick`` of the run before it,
  // and has the same ``kind(record)`` (null: never merged), joins that run.
  function mergeRuns(items, tick, kind) {
    // they come in the order they ran, so mostly sorted already: sort only if not
    for (let i = 1; i < items.length; i++) {
      const a = items[i - 1];
      const b = items[i];
      if (a[0] > b[0] || (a[0] === b[0] && a[1] > b[1])) {
        items.sort((x, y) => x[0] - y[0] || x[1] - y[1]);
        break;
      }
    }
    const out = [];
    let run = null;
    let runKind = null;
    for (const item of items) {
      const k = item[2] - item[1] < tick ? kind(item[3]) : null;
      if (run && k !== null && k === runKind && run[0] === item[0] && item[1] - run[2] < tick && run[2] - run[1] < 8 * tick) {
        run[2] = Math.max(run[2], item[2]);
        run[4] += item[4];
        continue;
      }
      run = item;
      runKind = k;
      out.push(run);
    }
    return out;
  }

  // the time (ms) one pixel of the task stream's axis spans, for records spanning [lo, hi] ms
  function pixelTime(c, lo, hi) {
    const width = Math.max(100, c.getWidth() - 160);
    const part = Math.max(1e-3, (stream.zoom.end - stream.zoom.start) / 100);
    return ((hi - lo) * part) / width;
  }

  function rowName(worker, thread) { return worker + " #" + thread; }

  function drawStream() {
    const c = chart("task-stream");
    if (!c) return;
    const records = stream.records.slice();
    const rowSet = new Map();
    for (const r of records) {
      if (!rowSet.has(r.row)) rowSet.set(r.row, [r.worker, r.thread]);
    }
    const rows = [...rowSet.keys()].sort((a, b) => {
      const [wa, ta] = rowSet.get(a);
      const [wb, tb] = rowSet.get(b);
      return wa === wb ? ta - tb : wa.localeCompare(wb, undefined, { numeric: true });
    });
    const rowIndex = new Map(rows.map((name, i) => [name, i]));
    // one list per row, so that each is in the order its tasks ran
    const byRow = rows.map(() => []);
    const moves = Object.fromEntries(PATHS.map((p) => [p, rows.map(() => [])]));
    let erred = 0;
    let lo = Infinity;
    let hi = -Infinity;
    records.forEach((r, i) => {
      const row = rowIndex.get(r.row);
      byRow[row].push([row, r.start * 1000, r.stop * 1000, i, 1]);
      lo = Math.min(lo, r.start * 1000);
      hi = Math.max(hi, r.stop * 1000);
      if (r.status !== "OK") erred++;
      (r.transfers || []).forEach((t, j) => {
        if (!moves[t.path]) return;
        moves[t.path][row].push([row, t.start * 1000, t.stop * 1000, i, 1, j]);
        lo = Math.min(lo, t.start * 1000);
      });
    });
    stream.drawn = records;
    const tick = records.length ? pixelTime(c, lo, hi) : 0;
    const tasks = mergeRuns(byRow.flat(), tick, (i) => (records[i].status === "OK" ? records[i].prefix : null));
    for (const p of PATHS) moves[p] = mergeRuns(moves[p].flat(), tick, () => p);

    const bar = (api, params, fraction, offset) => {
      const start = api.coord([api.value(1), api.value(0)]);
      const stop = api.coord([api.value(2), api.value(0)]);
      const rowHeight = api.size([0, 1])[1];
      const height = Math.max(2, rowHeight * fraction);
      const rect = {
        x: start[0],
        y: start[1] - rowHeight * 0.4 + rowHeight * offset,
        width: Math.max(1, stop[0] - start[0]),
        height: height,
      };
      const cs = params.coordSys;
      return echarts.graphic.clipRectByRect(rect, { x: cs.x, y: cs.y, width: cs.width, height: cs.height });
    };
    const taskItem = (params, api) => {
      const shape = bar(api, params, 0.8, 0);
      if (!shape) return null;
      const r = records[api.value(3)];
      const failed = r.status !== "OK";
      return {
        type: "rect", shape: shape,
        style: { fill: prefixColor(r.prefix), stroke: failed ? ERROR_COLOR : null, lineWidth: failed ? 2 : 0 },
      };
    };
    const moveItem = (path) => (params, api) => {
      const shape = bar(api, params, 0.25, 0.55);
      return shape ? { type: "rect", shape: shape, style: { fill: PATH_COLORS[path], opacity: 0.9 } } : null;
    };
    const series = [{
      name: "tasks", type: "custom", renderItem: taskItem, data: tasks,
      encode: { x: [1, 2], y: 0 }, itemStyle: { color: "#888" }, cursor: stream.clickable ? "pointer" : "default",
    }];
    for (const p of PATHS) {
      series.push({
        name: PATH_NAMES[p], type: "custom", renderItem: moveItem(p), data: moves[p],
        encode: { x: [1, 2], y: 0 }, itemStyle: { color: PATH_COLORS[p] }, z: 3,
      });
    }
    const many = rows.length > 24;
    fitHeight("task-stream", Math.min(rows.length, 24), 26, 240, 720);
    const option = {
      ...BASE,
      grid: { left: 8, right: many ? 48 : 16, top: 32, bottom: 56, containLabel: true },
      legend: { data: PATHS.map((p) => PATH_NAMES[p]), top: 0, right: 8 },
      tooltip: { trigger: "item", formatter: (p) => streamTooltip(p, records) },
      xAxis: { type: "time", scale: true, axisLabel: { hideOverlap: true, formatter: (v) => formatTime(v / 1000) } },
      yAxis: { type: "category", data: rows, inverse: true, axisLabel: { fontSize: 11 } },
      series: series,
    };
    const replace = ["series"];
    if (many !== stream.many) { // set once (and when rows pass 24): a redraw keeps where the reader zoomed
      stream.many = many;
      option.dataZoom = [
        { type: "inside", xAxisIndex: 0, filterMode: "weakFilter" },
        { type: "slider", xAxisIndex: 0, filterMode: "weakFilter", height: 18, bottom: 8, labelFormatter: (v) => formatTime(v / 1000) },
        ...(many ? [{ type: "slider", yAxisIndex: 0, startValue: 0, endValue: 23, right: 8, width: 16 }] : []),
      ];
      replace.push("dataZoom");
    }
    c.setOption(option, { replaceMerge: replace });
    const count = document.getElementById("task-count");
    if (count) {
      count.textContent = plural(records.length, "task", "tasks") + (erred ? ", " + erred + " erred" : "") +
        (records.length >= MAX_TASKS ? " (the latest " + MAX_TASKS + ")" : "");
    }
  }

  function streamTooltip(p, records) {
    if (!p.value) return "";
    const r = records[p.value[3]];
    if (!r) return "";
    const many = p.value[4] > 1 ? "<br>" + formatSeconds((p.value[2] - p.value[1]) / 1000) + ", narrower than a pixel each: click to zoom in" : "";
    if (p.seriesName === "tasks") {
      if (many) return "<b>" + plural(p.value[4], "task", "tasks") + " " + escapeHtml(r.prefix) + "</b><br>" + escapeHtml(rowName(r.worker, r.thread)) + many;
      return "<b>" + escapeHtml(r.key) + "</b><br>" + escapeHtml(rowName(r.worker, r.thread)) + "<br>" +
        formatSeconds(r.stop - r.start) + (r.status !== "OK" ? ' <span style="color:' + ERROR_COLOR + '">erred</span>' : "");
    }
    if (many) return escapeHtml(p.seriesName) + ": <b>" + plural(p.value[4], "transfer", "transfers") + "</b>" + many;
    const t = r.transfers[p.value[5]];
    return escapeHtml(p.seriesName) + ": <b>" + escapeHtml(t.key) + "</b><br>" + formatBytes(t.bytes) + " from " +
      escapeHtml(t.from) + " in " + formatSeconds(t.stop - t.start) + "<br>for " + escapeHtml(r.key);
  }

  function enableStreamClicks() {
    const c = chart("task-stream");
    c.on("click", (p) => {
      if (!p.value || !stream.drawn) return;
      if (p.value[4] > 1) { // a run of narrow tasks: zoom in on it
        const pad = (p.value[2] - p.value[1]) * 0.1;
        c.dispatchAction({ type: "dataZoom", dataZoomIndex: 0, startValue: p.value[1] - pad, endValue: p.value[2] + pad });
        return;
      }
      if (p.seriesName !== "tasks" || !stream.clickable) return;
      const r = stream.drawn[p.value[3]];
      if (r) window.location.href = "task?key=" + encodeURIComponent(r.key);
    });
    c.on("datazoom", () => {
      // what is in view changed: redraw soon, merging runs for the new scale
      const zoom = c.getModel().getComponent("dataZoom", 0);
      if (!zoom) return;
      const [start, end] = zoom.getPercentRange();
      stream.zoom = { start, end };
      later("stream", drawStream, true);
    });
  }

  // ---- progress per prefix: done / processing / waiting / erred, as parts of the total

  function progressParts(g) {
    const total = Math.max(0, g.total);
    const done = Math.min(g.done, total);
    const processing = Math.min(g.processing, total - done);
    const erred = Math.min(g.erred, total - done - processing);
    return { total, done, processing, erred, waiting: total - done - processing - erred };
  }

  function drawProgress(progress) {
    const c = chart("progress");
    if (!c) return;
    const groups = progress.prefixes || [];
    const parts = groups.map(progressParts);
    const labels = groups.map((g, i) => g.prefix + "  " + parts[i].done + "/" + parts[i].total);
    const pct = (n, t) => (t ? (100 * n) / t : 0);
    const series = ["done", "processing", "waiting", "erred"].map((s) => ({
      name: s, type: "bar", stack: "all", barMaxWidth: 22, itemStyle: { color: STATE_COLORS[s] },
      data: parts.map((p) => ({ value: pct(p[s], p.total), count: p[s] })),
      // the count inside its segment, where the segment has room for it
      label: { show: true, position: "inside", fontSize: 11, color: s === "waiting" ? "#24292f" : "#fff",
        formatter: (x) => (x.data.count && x.data.value >= 6 ? String(x.data.count) : "") },
    }));
    fitHeight("progress", groups.length, 28, 200, 640);
    c.setOption({
      ...BASE,
      grid: { left: 8, right: 24, top: 28, bottom: 8, containLabel: true },
      legend: { top: 0 },
      tooltip: {
        trigger: "axis", axisPointer: { type: "shadow" },
        formatter: (items) => {
          const i = items[0].dataIndex;
          return "<b>" + escapeHtml(groups[i].prefix) + "</b><br>" + items.map((it) =>
            it.marker + escapeHtml(it.seriesName) + ": " + it.data.count + " (" + it.data.value.toFixed(0) + "%)").join("<br>");
        },
      },
      xAxis: { type: "value", max: 100, axisLabel: { formatter: "{value}%" } },
      yAxis: { type: "category", data: labels, inverse: true },
      series: series,
    });
    const count = document.getElementById("progress-count");
    if (count) {
      const all = parts.reduce((a, p) => [a[0] + p.done, a[1] + p.total], [0, 0]);
      count.textContent = all[0] + "/" + all[1] + " done";
    }
  }

  // ---- memory and CPU per worker

  function workerLabel(w) { return w.name && w.name !== w.address ? w.name : w.address; }

  function drawMemory(workers) {
    const c = chart("memory");
    if (!c) return;
    const names = workers.map(workerLabel);
    const series = Object.keys(MEMORY_COLORS).map((k) => ({
      name: k, type: "bar", stack: "memory", barMaxWidth: 22, itemStyle: { color: MEMORY_COLORS[k] },
      data: workers.map((w) => w.memory[k] || 0),
    }));
    // a limit far above what is used would squeeze the bars to nothing: the axis then fits
    // the use, and each limit is written at the right edge instead of drawn
    const used = Math.max(0, ...workers.map((w) => Object.keys(MEMORY_COLORS).reduce((a, k) => a + (w.memory[k] || 0), 0)));
    const limit = Math.max(0, ...workers.map((w) => w.memory.limit || 0));
    const fits = limit <= 4 * used;
    series.push({
      name: "limit", type: "custom", z: 5, itemStyle: { color: "#24292f" },
      data: workers.map((w, i) => [fits ? w.memory.limit || 0 : 0, i, w.memory.limit || 0]),
      encode: { x: 0, y: 1 },
      renderItem: (params, api) => {
        const h = api.size([0, 1])[1] * 0.45;
        const cs = params.coordSys;
        if (!fits && api.value(2)) {
          const p = api.coord([0, api.value(1)]);
          return { type: "text", style: { text: "limit " + formatBytes(api.value(2)), x: cs.x + cs.width - 4, y: p[1],
            align: "right", verticalAlign: "middle", fill: "#57606a", fontSize: 11 } };
        }
        if (!api.value(0)) return null;
        const p = api.coord([api.value(0), api.value(1)]);
        return { type: "line", shape: { x1: p[0], y1: p[1] - h, x2: p[0], y2: p[1] + h }, style: { stroke: "#24292f", lineWidth: 2 } };
      },
    });
    fitHeight("memory", workers.length, 28, 200, 640);
    c.setOption({
      ...BASE,
      grid: { left: 8, right: 24, top: 28, bottom: 8, containLabel: true },
      legend: { top: 0 },
      tooltip: {
        trigger: "axis", axisPointer: { type: "shadow" },
        formatter: (items) => {
          const w = workers[items[0].dataIndex];
          return "<b>" + escapeHtml(w.address) + "</b><br>" + Object.keys(MEMORY_COLORS).map((k) => k + ": " +
            formatBytes(w.memory[k] || 0)).join("<br>") + "<br>limit: " + (w.memory.limit ? formatBytes(w.memory.limit) : "none");
        },
      },
      xAxis: { type: "value", min: 0, max: fits ? null : Math.max(1024, used * 1.25), axisLabel: { formatter: (v) => formatBytes(v) } },
      yAxis: { type: "category", data: names, inverse: true },
      series: series,
    }, { replaceMerge: ["series"] });
  }

  function drawCpu(workers) {
    const c = chart("cpu");
    if (!c) return;
    fitHeight("cpu", workers.length, 28, 200, 640);
    c.setOption({
      ...BASE,
      grid: { left: 8, right: 24, top: 16, bottom: 8, containLabel: true },
      tooltip: { trigger: "axis", axisPointer: { type: "shadow" }, valueFormatter: (v) => v.toFixed(0) + "%" },
      xAxis: { type: "value", min: 0, max: (e) => Math.max(100, Math.ceil(e.max / 100) * 100), axisLabel: { formatter: "{value}%" } },
      yAxis: { type: "category", data: workers.map(workerLabel), inverse: true },
      series: [{ name: "cpu", type: "bar", barMaxWidth: 22, itemStyle: { color: "#5470c6" }, data: workers.map((w) => w.cpu || 0) }],
    });
  }

  // ---- bytes moved per second by path (live: differences of the cumulative totals)

  const rates = { last: null, points: { inproc: [], shm: [], tcp: [] } };

  function addTransfers(totals) {
    const last = rates.last;
    rates.last = totals;
    if (!last) return;
    const dt = totals.time - last.time;
    if (!(dt > 0)) return;
    for (const p of PATHS) {
      const points = rates.points[p];
      points.push([totals.time * 1000, Math.max(0, (totals[p] - last[p]) / dt)]);
      const horizon = (totals.time - RATE_WINDOW_S) * 1000;
      while (points.length && points[0][0] < horizon) points.shift();
    }
  }

  function drawRates(points) {
    const c = chart("transfer-rate");
    if (!c) return;
    c.setOption({
      ...BASE,
      grid: { left: 8, right: 24, top: 32, bottom: 8, containLabel: true },
      legend: { top: 0 },
      tooltip: { trigger: "axis", valueFormatter: (v) => formatBytes(v) + "/s" },
      xAxis: { type: "time", axisLabel: { hideOverlap: true, formatter: (v) => formatTime(v / 1000) } },
      yAxis: { type: "value", min: 0, minInterval: 1, axisLabel: { formatter: (v) => formatBytes(v) + "/s" } },
      series: PATHS.map((p) => ({
        name: PATH_NAMES[p], type: "line", showSymbol: false, itemStyle: { color: PATH_COLORS[p] },
        areaStyle: { opacity: 0.15 }, data: points[p],
      })),
    });
  }

  // the report's rates: the task stream's transfers, spread over bins of its time span
  function ratesFromRecords(records) {
    const points = { inproc: [], shm: [], tcp: [] };
    let lo = Infinity;
    let hi = -Infinity;
    for (const r of records) for (const t of r.transfers || []) { lo = Math.min(lo, t.start); hi = Math.max(hi, t.stop); }
    if (!(hi >= lo)) return points;
    const bins = 120;
    const width = Math.max((hi - lo) / bins, 1e-3);
    const sums = Object.fromEntries(PATHS.map((p) => [p, new Float64Array(bins + 1)]));
    for (const r of records) {
      for (const t of r.transfers || []) {
        if (!sums[t.path]) continue;
        sums[t.path][Math.min(bins, Math.floor((t.stop - lo) / width))] += t.bytes;
      }
    }
    for (const p of PATHS) {
      for (let i = 0; i <= bins; i++) points[p].push([(lo + (i + 0.5) * width) * 1000, sums[p][i] / width]);
    }
    return points;
  }

  // ---- the summary line

  function drawSummary(s, extra) {
    const node = document.getElementById("summary");
    if (!node || !s) return;
    const item = (label, value, cls) => el("span", { class: cls }, [label + " ", el("b", { text: String(value ?? "\u2014") })]);
    node.replaceChildren(
      item("scheduler", s.address || "\u2014"),
      item("workers", s.workers),
      item("threads", s.threads),
      item("tasks", s.tasks),
      item("processing", s.processing),
      item("waiting", s.waiting),
      item("in memory", s.memory),
      item("erred", s.erred, s.erred ? "erred" : ""),
      item("memory", formatBytes(workersMemory(extra))),
    );
  }

  function workersMemory(workers) {
    return (workers || []).reduce((a, w) => a + (w.memory.managed || 0) + (w.memory.unmanaged || 0), 0);
  }

  // ------------------------------------------------------------------ live updates

  function listen(onUpdate) {
    const source = new EventSource("api/v1/events");
    source.addEventListener("open", () => setConnection("live", "live"));
    source.addEventListener("error", () => setConnection("reconnecting\u2026", "lost"));
    source.addEventListener("update", (ev) => {
      let update;
      try { update = JSON.parse(ev.data); } catch (e) { return; }
      state.updates++;
      onUpdate(update);
    });
    return source;
  }

  const state = { updates: 0, workers: [], progress: null, graph: null, summary: null };

  // ------------------------------------------------------------------ pages

  async function statusPage() {
    enableStreamClicks();
    drawRates(rates.points);
    try {
      const summary = await getJSON("api/v1/summary");
      const total = summary.task_stream_total || 0;
      let since = Math.max(0, total - MAX_TASKS);
      for (;;) {
        const got = await getJSON("api/v1/task-stream?since=" + since);
        addRecords(got.records);
        if (!got.records.length || got.next <= since || got.next >= total) break;
        since = got.next;
      }
      drawStream();
    } catch (e) {
      setConnection("no answer: " + e.message, "lost");
    }
    listen((u) => {
      if (u.summary && u.summary.task_stream_total < stream.next) { // a new scheduler: start again
        stream.records = [];
        stream.next = 0;
      }
      state.summary = u.summary;
      state.workers = u.workers || [];
      later("summary", () => drawSummary(state.summary, state.workers));
      if (u.task_stream && u.task_stream.records.length) {
        addRecords(u.task_stream.records);
        later("stream", drawStream);
      }
      if (u.progress) { state.progress = u.progress; later("progress", () => drawProgress(state.progress), false, JSON.stringify(u.progress)); }
      const names = state.workers.map(workerLabel).join("\n");
      later("memory", () => drawMemory(state.workers), false, names + JSON.stringify(state.workers.map((w) => w.memory)));
      later("cpu", () => drawCpu(state.workers), false, names + state.workers.map((w) => Math.round(w.cpu || 0)).join());
      if (u.transfers) { addTransfers(u.transfers); later("rates", () => drawRates(rates.points)); }
    });
  }

  function pathCell(bytes) {
    const lines = PATHS.map((p) => el("div", { text: PATH_NAMES[p] + " " + formatBytes((bytes || {})[p] || 0) }));
    return el("td", { class: "paths" }, lines);
  }

  function drawWorkersTable(workers, now) {
    const body = document.querySelector("#workers tbody");
    const num = (text) => el("td", { class: "num", text: text });
    const rows = workers.map((w) => {
      const m = w.memory;
      const ago = w.last_seen === null || w.last_seen === undefined ? "\u2014" : Math.max(0, now - w.last_seen).toFixed(1) + " s ago";
      const tr = el("tr", { class: w.status === "paused" ? "paused" : "", "data-address": w.address }, [
        el("td", { class: "key", text: w.address }),
        el("td", { text: w.name }),
        el("td", { text: w.host }),
        num(w.nthreads), num(w.processing), num(w.held),
        num(formatBytes(m.managed)), num(formatBytes(m.shm)), num(formatBytes(m.spilled)),
        num(formatBytes(m.unmanaged)), num(m.limit ? formatBytes(m.limit) : "none"),
        num((w.cpu || 0).toFixed(0) + "%"),
        pathCell(w.transfers_in), pathCell(w.transfers_out),
        num(ago),
        el("td", { class: "status", text: w.status }),
      ]);
      return tr;
    });
    body.replaceChildren(...rows);
    const count = document.getElementById("worker-count");
    if (count) count.textContent = plural(workers.length, "worker", "workers");
  }

  async function workersPage() {
    try {
      const [summary, workers] = await Promise.all([getJSON("api/v1/summary"), getJSON("api/v1/workers")]);
      state.workers = workers;
      drawSummary(summary, workers);
      drawWorkersTable(workers, summary.time);
    } catch (e) {
      setConnection("no answer: " + e.message, "lost");
    }
    listen((u) => {
      state.workers = u.workers || [];
      state.summary = u.summary;
      later("workers", () => {
        drawSummary(state.summary, state.workers);
        drawWorkersTable(state.workers, state.summary ? state.summary.time : Date.now() / 1000);
      });
    });
  }

  // ---- one task

  function drawTask(t) {
    const node = document.getElementById("task");
    const fact = (label, value) => [el("dt", { text: label }), el("dd", {}, [value])];
    const whoHas = (list) => (list && list.length ? list.join(", ") : "\u2014");
    const facts = el("dl", { class: "facts" }, [
      ...fact("key", el("span", { class: "key", text: t.key })),
      ...fact("prefix", t.prefix),
      ...fact("state", el("span", { class: "state state-" + t.state, id: "task-state", text: t.state })),
      ...fact("worker", t.worker || "\u2014"),
      ...fact("held by", whoHas(t.who_has)),
      ...fact("ran", t.start ? formatTime(t.start) + " \u2192 " + formatTime(t.stop) : "\u2014"),
      ...fact("duration", formatSeconds(t.duration)),
      ...fact("size", formatBytes(t.nbytes)),
    ]);
    const parts = [el("section", { class: "panel" }, [el("h2", { text: "Task" }), facts])];
    if (t.error || t.traceback) {
      const children = [el("h2", { text: "Error" }), el("div", { class: "error-text", id: "task-error", text: t.error || "" })];
      if (t.traceback) children.push(el("pre", { class: "traceback", id: "task-traceback", text: t.traceback }));
      parts.push(el("section", { class: "panel" }, children));
    }
    const deps = (t.dependencies || []).map((d) => el("tr", {}, [
      el("td", {}, [taskLink(d.key)]),
      el("td", { class: "state state-" + d.state, text: d.state }),
      el("td", { text: whoHas(d.who_has) }),
      el("td", { text: d.transfer ? PATH_NAMES[d.transfer.path] || d.transfer.path : "\u2014" }),
      el("td", { class: "num", text: d.transfer ? formatBytes(d.transfer.bytes) : "\u2014" }),
      el("td", { text: d.transfer ? "from " + d.transfer.from + " in " + formatSeconds(d.transfer.stop - d.transfer.start) : "" }),
    ]));
    parts.push(section("Dependencies (" + deps.length + ")", deps.length
      ? table(["key", "state", "held by", "came by", "bytes", ""], deps, [4]) : el("p", { class: "muted", text: "none" })));
    const dependents = t.dependents || [];
    parts.push(section("Dependents (" + dependents.length + ")", dependents.length
      ? el("ul", {}, dependents.map((k) => el("li", {}, [taskLink(k)]))) : el("p", { class: "muted", text: "none" })));
    const story = (t.story || []).map((s) => el("tr", {}, [
      el("td", { class: "state state-" + s.start, text: s.start }),
      el("td", { text: "\u2192" }),
      el("td", { class: "state state-" + s.finish, text: s.finish }),
      el("td", { class: "key", text: s.stimulus_id }),
    ]));
    const storyTable = table(["from", "", "to", "stimulus id"], story, []);
    storyTable.id = "task-story";
    parts.push(section("Story (" + story.length + " transitions)", story.length ? storyTable : el("p", { class: "muted", text: "none kept" })));
    node.replaceChildren(...parts);
  }

  function section(title, body) {
    return el("section", { class: "panel" }, [el("h2", { text: title }), body]);
  }

  function table(headers, rows, numeric) {
    const head = el("tr", {}, headers.map((h, i) => el("th", { class: numeric.includes(i) ? "num" : null, text: h })));
    return el("table", { class: "data" }, [el("thead", {}, [head]), el("tbody", {}, rows)]);
  }

  function taskPage() {
    const key = new URLSearchParams(window.location.search).get("key");
    const input = document.getElementById("search-input");
    const results = document.getElementById("search-results");
    let asked = 0;
    const search = async (text) => {
      const mine = ++asked;
      if (!text) { results.replaceChildren(); return []; }
      let found = [];
      try { found = await getJSON("api/v1/search?q=" + encodeURIComponent(text)); } catch (e) { found = []; }
      if (mine !== asked) return found;
      results.replaceChildren(...(found.length ? found.map((k) => el("li", {}, [taskLink(k)]))
        : [el("li", { class: "muted", text: "no task key holds \u201c" + text + "\u201d" })]));
      return found;
    };
    let pending = null;
    input.addEventListener("input", () => {
      clearTimeout(pending);
      pending = setTimeout(() => search(input.value.trim()), 200);
    });
    document.getElementById("search").addEventListener("submit", async (ev) => {
      ev.preventDefault();
      clearTimeout(pending);
      const text = input.value.trim();
      const found = await search(text);
      if (found.length === 1 || found.includes(text)) {
        window.location.href = "task?key=" + encodeURIComponent(found.includes(text) ? text : found[0]);
      }
    });
    if (!key) return;
    input.value = key;
    document.title = "shoal: " + key;
    let shown = null;
    const refresh = async () => {
      try {
        const t = await getJSON("api/v1/task?key=" + encodeURIComponent(key));
        const text = JSON.stringify(t);
        if (text !== shown) { shown = text; drawTask(t); state.task = t; }
        setConnection("live", "live");
      } catch (e) {
        if (e.status === 404) { // asked no more: a forgotten key does not come back
          document.getElementById("task").replaceChildren(el("p", { class: "notice", id: "task-missing",
            text: "The scheduler knows no task " + key + " (it may have been forgotten)." }));
          return;
        } else {
          setConnection("no answer: " + e.message, "lost");
        }
      }
      setTimeout(refresh, TASK_REFRESH_MS);
    };
    refresh();
  }

  // ---- the graph of prefixes, layered left to right by dependency depth

  function layers(nodes, edges) {
    const names = nodes.map((n) => n.prefix);
    const known = new Set(names);
    const incoming = new Map(names.map((n) => [n, 0]));
    const out = new Map(names.map((n) => [n, []]));
    for (const e of edges) {
      if (!known.has(e.from) || !known.has(e.to) || e.from === e.to) continue;
      out.get(e.from).push(e.to);
      incoming.set(e.to, incoming.get(e.to) + 1);
    }
    const depth = new Map();
    const queue = names.filter((n) => incoming.get(n) === 0).sort();
    for (const n of queue) depth.set(n, 0);
    for (let i = 0; i < queue.length; i++) { // Kahn's order: a node's depth is its longest path from a root
      const n = queue[i];
      for (const m of out.get(n)) {
        depth.set(m, Math.max(depth.get(m) || 0, depth.get(n) + 1));
        incoming.set(m, incoming.get(m) - 1);
        if (incoming.get(m) === 0) queue.push(m);
      }
    }
    let deepest = Math.max(-1, ...depth.values());
    for (const n of names.slice().sort()) if (!depth.has(n)) depth.set(n, ++deepest); // on a cycle of prefixes
    return depth;
  }

  function stateGradient(p) {
    if (!p.total) return STATE_COLORS.waiting;
    const stops = [];
    let at = 0;
    for (const s of ["done", "processing", "erred", "waiting"]) {
      const share = p[s] / p.total;
      if (share <= 0) continue;
      stops.push({ offset: at, color: STATE_COLORS[s] }, { offset: Math.min(1, at + share), color: STATE_COLORS[s] });
      at += share;
    }
    return { type: "linear", x: 0, y: 1, x2: 0, y2: 0, colorStops: stops };
  }

  function drawGraph(graph) {
    const c = chart("graph");
    if (!c) return;
    const nodes = graph.nodes || [];
    const depth = layers(nodes, graph.edges || []);
    const byLayer = new Map();
    for (const n of nodes.slice().sort((a, b) => (a.prefix < b.prefix ? -1 : 1))) {
      const d = depth.get(n.prefix);
      if (!byLayer.has(d)) byLayer.set(d, []);
      byLayer.get(d).push(n);
    }
    const biggest = Math.max(1, ...nodes.map((n) => n.total));
    const data = [];
    const columns = byLayer.size;
    const rows = Math.max(0, ...[...byLayer.values()].map((l) => l.length));
    for (const [d, layer] of byLayer) {
      layer.forEach((n, i) => {
        const p = progressParts(n);
        data.push({
          name: n.prefix, x: d * 240, y: (i - (layer.length - 1) / 2) * 90,
          symbolSize: 18 + 46 * Math.sqrt(n.total / biggest),
          itemStyle: { color: stateGradient(p), borderColor: n.erred ? ERROR_COLOR : "#57606a", borderWidth: n.erred ? 2 : 1 },
          label: { show: true, position: "bottom", formatter: n.prefix + " " + p.done + "/" + p.total },
          counts: p,
        });
      });
    }
    const known = new Set(nodes.map((n) => n.prefix));
    const links = (graph.edges || []).filter((e) => known.has(e.from) && known.has(e.to) && e.from !== e.to)
      .map((e) => ({ source: e.from, target: e.to }));
    c.setOption({
      ...BASE,
      tooltip: {
        formatter: (p) => {
          if (p.dataType === "edge") return escapeHtml(p.data.source) + " \u2192 " + escapeHtml(p.data.target);
          const k = p.data.counts;
          return "<b>" + escapeHtml(p.name) + "</b><br>" + ["done", "processing", "waiting", "erred"]
            .map((s) => s + ": " + k[s]).join("<br>") + "<br>total: " + k.total;
        },
      },
      series: [{
        type: "graph", layout: "none", roam: true, data: data, links: links,
        // the layout's own size, or less when it does not fit: a few nodes are not spread over the whole page
        left: "center", top: "middle",
        width: Math.min(c.getWidth() - 160, Math.max(1, columns - 1) * 240),
        height: Math.min(c.getHeight() - 80, Math.max(1, rows - 1) * 90),
        edgeSymbol: ["none", "arrow"], edgeSymbolSize: 8,
        lineStyle: { color: "#8c959f", width: 1.5, curveness: 0.08 },
        emphasis: { focus: "adjacency" },
      }],
    }, { replaceMerge: ["series"] });
    const count = document.getElementById("graph-count");
    if (count) count.textContent = plural(nodes.length, "prefix", "prefixes") + ", " + plural(links.length, "edge", "edges");
  }

  function graphPage() {
    const refresh = async () => {
      try {
        const graph = await getJSON("api/v1/graph");
        const text = JSON.stringify(graph);
        if (text !== state.graphText) { state.graphText = text; state.graph = graph; drawGraph(graph); }
        setConnection("live", "live");
      } catch (e) {
        setConnection("no answer: " + e.message, "lost");
      }
      setTimeout(refresh, GRAPH_REFRESH_MS);
    };
    refresh();
  }

  // ---- the offline report: the same charts, from the embedded JSON, once

  function reportPage() {
    const data = JSON.parse(document.getElementById("shoal-data").textContent);
    const records = data.task_stream || [];
    stream.clickable = false; // no task pages offline (a run of narrow tasks still zooms)
    enableStreamClicks();
    addRecords(records.map((r, i) => (r.index === undefined ? { ...r, index: i } : r)));
    drawStream();
    state.workers = data.workers || [];
    drawSummary(data.summary, state.workers);
    state.progress = data.progress || { prefixes: [] };
    drawProgress(state.progress);
    drawMemory(state.workers);
    drawCpu(state.workers);
    drawRates(ratesFromRecords(records));
    const moved = document.getElementById("moved");
    if (moved && data.transfers && data.transfers.start && data.transfers.stop) {
      const t = data.transfers;
      moved.textContent = PATHS.map((p) => PATH_NAMES[p] + " " + formatBytes(Math.max(0, (t.stop[p] || 0) - (t.start[p] || 0))))
        .join(", ") + " in " + formatSeconds(data.duration);
    }
  }

  // ------------------------------------------------------------------ what tests and the curious read

  function option(id) {
    const c = charts[id];
    const o = c ? c.getOption() : null;
    return o && o.series ? o : null;
  }

  function seriesData(id, name) {
    const o = option(id);
    const s = o ? o.series.find((x) => x.name === name) : null;
    return s ? s.data : [];
  }

  window.shoalDashboard = {
    /** tasks the task-stream chart shows (from its data, as last drawn; a run of narrow tasks drawn as one counts each) */
    taskCount() { return seriesData("task-stream", "tasks").reduce((n, item) => n + item[4], 0); },
    /** rectangles drawn for tasks in the task-stream chart (runs of narrow tasks merged) */
    taskRectangles() { return seriesData("task-stream", "tasks").length; },
    /** transfers the task-stream chart shows, by path */
    transferCounts() {
      return Object.fromEntries(PATHS.map((p) => [p, seriesData("task-stream", PATH_NAMES[p]).reduce((n, item) => n + item[4], 0)]));
    },
    /** where task ``key``'s rectangle is drawn, in page pixels ({x, y} of its middle), or null */
    taskPoint(key) {
      const o = option("task-stream");
      const r = (stream.drawn || []).find((x) => x.key === key);
      if (!o || !r) return null;
      const c = charts["task-stream"];
      const row = o.yAxis[0].data.indexOf(rowName(r.worker, r.thread));
      const [x, y] = c.convertToPixel({ gridIndex: 0 }, [(r.start + r.stop) * 500, row]);
      const box = c.getDom().getBoundingClientRect();
      return { x: box.left + x, y: box.top + y };
    },
    /** {prefix: percent done} as the progress chart shows it */
    progress() {
      const done = seriesData("progress", "done");
      const out = {};
      if (!state.progress || done.length !== state.progress.prefixes.length) return out;
      state.progress.prefixes.forEach((g, i) => { out[g.prefix] = done[i].value; });
      return out;
    },
    /** the workers the page shows (the table's rows, or the memory chart's bars) */
    workers() {
      const rows = document.querySelectorAll("#workers tbody tr");
      if (rows.length) return [...rows].map((r) => r.dataset.address);
      const o = option("memory");
      return o ? o.yAxis[0].data : [];
    },
    /** names of the nodes of the graph chart */
    graphNodes() {
      const o = option("graph");
      return o ? o.series[0].data.map((d) => d.name) : [];
    },
    /** the highest rate (bytes per second) the transfer chart shows, by path */
    rates() {
      return Object.fromEntries(PATHS.map((p) => [p, Math.max(0, ...seriesData("transfer-rate", PATH_NAMES[p]).map((x) => x[1]))]));
    },
    /** updates heard from the event stream */
    updates() { return state.updates; },
    /** the task the task page shows */
    task() { return state.task || null; },
    charts: charts,
  };

  function start() {
    const page = document.body.dataset.page;
    const pages = { status: statusPage, workers: workersPage, task: taskPage, graph: graphPage, report: reportPage };
    if (pages[page]) pages[page]();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
