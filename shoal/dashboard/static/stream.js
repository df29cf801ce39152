// shoal dashboard, 2 of 4 (stream.js): the task stream, one row per worker thread, a
// rectangle per task and its inputs' transfers before it. Tasks narrower than a pixel
// that follow each other on a row with the same prefix are drawn as one rectangle
// (mergeRuns); zooming in (or clicking such a run) draws them one by one, and clicking
// a task opens its page.
(function (parts) {
  "use strict";

  const {
    MAX_TASKS, PATHS, PATH_NAMES, PATH_COLORS, ERROR_COLOR, BASE,
    escapeHtml, formatBytes, formatSeconds, formatTime, plural, prefixColor, chart, fitHeight, later,
  } = parts;

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
      return "<b>" + escapeHtml(keyText(r)) + "</b><br>" + escapeHtml(rowName(r.worker, r.thread)) + "<br>" +
        formatSeconds(r.stop - r.start) + (r.status !== "OK" ? ' <span style="color:' + ERROR_COLOR + '">erred</span>' : "");
    }
    if (many) return escapeHtml(p.seriesName) + ": <b>" + plural(p.value[4], "transfer", "transfers") + "</b>" + many;
    const t = r.transfers[p.value[5]];
    return escapeHtml(p.seriesName) + ": <b>" + escapeHtml(keyText(t)) + "</b><br>" + formatBytes(t.bytes) + " from " +
      escapeHtml(t.from) + " in " + formatSeconds(t.stop - t.start) + "<br>for " + escapeHtml(keyText(r));
  }

  // a record's key, or what stands for it where the server hides keys (a viewer who
  // has not logged in to an open dashboard gets records whose key is null)
  function keyText(r) {
    if (r.key !== null && r.key !== undefined) return r.key;
    return (r.prefix ? "a task of " + r.prefix : "an input") + " (log in to see its key)";
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
      if (r && r.key !== null && r.key !== undefined) window.location.href = "task?key=" + encodeURIComponent(r.key);
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

  Object.assign(parts, { stream, addRecords, drawStream, enableStreamClicks, rowName });
})(window.shoalParts);
