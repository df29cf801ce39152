// shoal dashboard, 3 of 4 (charts.js): the charts besides the task stream, each drawn
// by a function of plain data (the shapes of the JSON API): progress per prefix, memory
// and CPU per worker, bytes moved per second by path, the summary line, and the graph
// of prefixes.
(function (parts) {
  "use strict";

  const {
    PATHS, PATH_NAMES, PATH_COLORS, ERROR_COLOR, STATE_COLORS, BASE,
    el, escapeHtml, formatBytes, formatTime, plural, chart, fitHeight,
  } = parts;

  const RATE_WINDOW_S = 300;
  const MEMORY_COLORS = { managed: "#5470c6", shm: "#9467bd", spilled: "#8d99ae", unmanaged: "#fac858" };

  // ---- charts of horizontal bars, a row per label (progress, memory, CPU)

  // the option of such a chart: ``legend`` names the parts of stacked bars above them
  // (one bar a row needs none, and the chart starts higher); the tooltip, whose
  // ``tooltip`` members are added, speaks of the row under the pointer
  function barsOption({ labels, series, xAxis, tooltip, legend }) {
    return {
      ...BASE,
      grid: { left: 8, right: 24, top: legend ? 28 : 16, bottom: 8, containLabel: true },
      ...(legend ? { legend: { top: 0 } } : {}),
      tooltip: { trigger: "axis", axisPointer: { type: "shadow" }, ...tooltip },
      xAxis: xAxis,
      yAxis: { type: "category", data: labels, inverse: true },
      series: series,
    };
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
    c.setOption(barsOption({
      labels: labels, series: series, legend: true,
      xAxis: { type: "value", max: 100, axisLabel: { formatter: "{value}%" } },
      tooltip: {
        formatter: (items) => {
          const i = items[0].dataIndex;
          return "<b>" + escapeHtml(groups[i].prefix) + "</b><br>" + items.map((it) =>
            it.marker + escapeHtml(it.seriesName) + ": " + it.data.count + " (" + it.data.value.toFixed(0) + "%)").join("<br>");
        },
      },
    }));
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
    c.setOption(barsOption({
      labels: names, series: series, legend: true,
      xAxis: { type: "value", min: 0, max: fits ? null : Math.max(1024, used * 1.25), axisLabel: { formatter: (v) => formatBytes(v) } },
      tooltip: {
        formatter: (items) => {
          const w = workers[items[0].dataIndex];
          return "<b>" + escapeHtml(w.address) + "</b><br>" + Object.keys(MEMORY_COLORS).map((k) => k + ": " +
            formatBytes(w.memory[k] || 0)).join("<br>") + "<br>limit: " + (w.memory.limit ? formatBytes(w.memory.limit) : "none");
        },
      },
    }), { replaceMerge: ["series"] });
  }

  function drawCpu(workers) {
    const c = chart("cpu");
    if (!c) return;
    fitHeight("cpu", workers.length, 28, 200, 640);
    c.setOption(barsOption({
      labels: workers.map(workerLabel),
      series: [{ name: "cpu", type: "bar", barMaxWidth: 22, itemStyle: { color: "#5470c6" }, data: workers.map((w) => w.cpu || 0) }],
      xAxis: { type: "value", min: 0, max: (e) => Math.max(100, Math.ceil(e.max / 100) * 100), axisLabel: { formatter: "{value}%" } },
      tooltip: { valueFormatter: (v) => v.toFixed(0) + "%" },
    }));
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

  Object.assign(parts, {
    workerLabel, drawProgress, drawMemory, drawCpu, rates, addTransfers, drawRates, ratesFromRecords, drawSummary,
    drawGraph,
  });
})(window.shoalParts);
