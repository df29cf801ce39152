// shoal dashboard, 1 of 4 (common.js): what the other scripts build on.
//
// The dashboard's code is four plain scripts, loaded by the pages in this order and
// inlined by the offline report as one, in the same order:
//   common.js  constants, helpers for elements, numbers and requests, the charts by
//              element id, and the pacing of drawing (later, drawPass)
//   stream.js  the task stream: the records kept, runs of narrow tasks (mergeRuns),
//              its chart, its clicks and zoom
//   charts.js  the other charts: progress, memory and CPU per worker, bytes moved per
//              second, the summary line, the graph of prefixes
//   pages.js   what each page does when it opens (status, workers, task, graph, the
//              report), the event stream, and window.shoalDashboard
// Each script is a function run once: it takes what it uses from window.shoalParts (put
// there by the scripts before it) and adds what the scripts after it use.
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
// the rate of updates: a page left open costs the cluster's host little. Tasks narrower
// than a pixel that follow each other on one row with the same prefix are drawn as one
// rectangle (the picture is the same, the cost is bounded by the chart's width, not by
// the task rate); zooming in draws each.
// Every URL is relative, so the dashboard also works behind a path prefix.
// window.shoalDashboard exposes what the charts hold, for tests and for the curious.
(function (parts) {
  "use strict";

  const MAX_TASKS = 20000;
  const DRAW_MS = 1000;
  const DRAW_COST_FACTOR = 19; // a drawing pass waits at least this many times as long as the last one took

  const PATHS = ["inproc", "shm", "tcp"];
  const PATH_NAMES = { inproc: "by reference", shm: "shared memory", tcp: "tcp" };
  const PATH_COLORS = { inproc: "#17becf", shm: "#9467bd", tcp: "#ff7f0e" };
  const ERROR_COLOR = "#d62728";
  const STATE_COLORS = { done: "#3ba272", processing: "#5470c6", waiting: "#c8ccd2", erred: ERROR_COLOR };

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
      // (a viewer of an open dashboard who has not logged in is told so in the nav bar already)
      if (response.status === 401 && !document.getElementById("anonymous")) {
        setConnection("logged out: open the dashboard's link again", "lost");
      }
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

  const charts = {}; // by element id

  // what the options of every chart begin with
  const BASE = { animation: false, textStyle: { fontFamily: "inherit" } };

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

  Object.assign(parts, {
    MAX_TASKS, PATHS, PATH_NAMES, PATH_COLORS, ERROR_COLOR, STATE_COLORS, BASE,
    el, escapeHtml, formatBytes, formatSeconds, formatTime, plural, taskLink, prefixColor, getJSON, setConnection,
    charts, chart, fitHeight, later,
  });
})(window.shoalParts = {});
