// shoal dashboard, 4 of 4 (pages.js): what each page does when it opens. The status
// and workers pages fetch what is there, then listen to the event stream and draw what
// changed (paced by later); the task and graph pages ask the JSON API every few
// seconds; the report draws once from the JSON embedded in it. Last, what the charts
// hold is exposed as window.shoalDashboard, and the page named by
// <body data-page="..."> starts.
(function (parts) {
  "use strict";

  const {
    MAX_TASKS, PATHS, PATH_NAMES, el, formatBytes, formatSeconds, formatTime, plural, taskLink, getJSON,
    setConnection, charts, later,
    stream, addRecords, drawStream, enableStreamClicks, rowName,
    workerLabel, drawProgress, drawMemory, drawCpu, rates, addTransfers, drawRates, ratesFromRecords, drawSummary,
    drawGraph,
  } = parts;

  const GRAPH_REFRESH_MS = 2000;
  const TASK_REFRESH_MS = 2000;

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
      let refused = null;
      try { found = await getJSON("api/v1/search?q=" + encodeURIComponent(text)); } catch (e) { found = []; refused = e.status === 401 ? e.message : null; }
      if (mine !== asked) return found;
      if (refused) { results.replaceChildren(el("li", { class: "muted", text: refused })); return found; }
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
        } else if (e.status === 401 || e.status === 403) { // not logged in: asked no more either
          document.getElementById("task").replaceChildren(el("p", { class: "notice", id: "task-login",
            text: e.message }));
          return;
        } else {
          setConnection("no answer: " + e.message, "lost");
        }
      }
      setTimeout(refresh, TASK_REFRESH_MS);
    };
    refresh();
  }

  // ---- the graph of prefixes

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
})(window.shoalParts);
