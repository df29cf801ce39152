"use strict";
// Fetching dependencies from their holders with get-data (docs/protocol.md §7.2,
// §8.1): the keys wanted within one event-loop turn are batched per holder (up to
// 64 MiB by the sizes the scheduler gave), one fetch of a key at a time however many
// tasks want it, connections kept per peer for reuse.

const { OOB, decodeMessage, encodeMessage, keyFromId, untuple } = require("./codec");
const { MB, connect } = require("./conn");
const { handshake } = require("./handshake");

const BATCH_BYTES = 64 * MB;
const BATCH_KEYS = 1000;
const REQUEST_TIMEOUT = 60_000;
const CONNECT_TIMEOUT = 10_000;
const IDLE_CLOSE = 60_000; // a pooled connection unused this long is closed
const ATTEMPTS = 4; // connections that fail for want of resources (§7.2 gather-attempts)
const RESOURCE_ERRORS = new Set(["EMFILE", "ENFILE", "ENOMEM", "ENOBUFS", "ECONNRESET"]);

function isMap(v) {
  return v !== null && typeof v === "object" && !Array.isArray(v) && !(v instanceof Uint8Array) && !(v instanceof OOB);
}

class Fetcher {
  constructor(worker) {
    this.worker = worker;
    this.inflight = new Map(); // key id -> Promise of the fetch's result
    this.pending = []; // fetches waiting for the next batch
    this.scheduled = false;
    this.idle = new Map(); // address -> [Conn]
    this.closed = false;
  }

  /**
   * The value of `depId` from one of `holders`: resolves with `{entry}` (an entry for
   * the task thread), `{missing: true}` when no holder has it, or `{error}` when it
   * cannot be read here (a SerializationError the task errs with).
   */
  fetch(depId, holders, nbytes) {
    let promise = this.inflight.get(depId);
    if (promise === undefined) {
      promise = new Promise((resolve) => {
        const others = holders.filter((h) => h !== this.worker.address);
        this.pending.push({ depId, holders: others, tried: new Set(), nbytes, resolve });
        this.schedule();
      });
      this.inflight.set(depId, promise);
      promise.then(() => this.inflight.delete(depId));
    }
    return promise;
  }

  schedule() {
    if (this.scheduled) return;
    this.scheduled = true;
    setImmediate(() => this.flushPending());
  }

  flushPending() {
    this.scheduled = false;
    const groups = new Map(); // holder -> items
    for (const item of this.pending.splice(0)) {
      const left = item.holders.filter((h) => !item.tried.has(h));
      if (!left.length) {
        item.resolve({ missing: true });
        continue;
      }
      // a holder already asked in this round takes one more key; else any at random
      const holder = left.find((h) => groups.has(h)) ?? left[Math.floor(Math.random() * left.length)];
      if (!groups.has(holder)) groups.set(holder, []);
      groups.get(holder).push(item);
    }
    for (const [holder, items] of groups) {
      let batch = [];
      let bytes = 0;
      for (const item of items) {
        if (batch.length && (bytes + item.nbytes > BATCH_BYTES || batch.length >= BATCH_KEYS)) {
          this.getData(holder, batch);
          batch = [];
          bytes = 0;
        }
        batch.push(item);
        bytes += item.nbytes;
      }
      if (batch.length) this.getData(holder, batch);
    }
  }

  /** The next holder for these items, or the end of their search. */
  retry(holder, items, missing) {
    for (const item of items) {
      item.tried.add(holder);
      if (missing) this.worker.send({ op: "missing-data", key: keyFromId(item.depId), errant_worker: holder });
      this.pending.push(item);
    }
    this.schedule();
  }

  async getData(holder, items) {
    let response;
    try {
      response = await this.request(holder, {
        op: "get-data",
        reply: true,
        keys: items.map((i) => keyFromId(i.depId)),
      });
    } catch (err) {
      // a fetch that fails counts as the holder not having the keys (§7.2)
      process.stderr.write(`shoal-worker: get-data from ${holder} failed: ${err.message}\n`);
      this.retry(holder, items, true);
      return;
    }
    if (response.status === "OK") {
      const data = isMap(response.result) && isMap(response.result.data) ? response.result.data : {};
      const absent = [];
      for (const item of items) {
        if (Object.hasOwn(data, item.depId)) item.resolve(entryOf(item.depId, data[item.depId]));
        else absent.push(item);
      }
      if (absent.length) this.retry(holder, absent, true);
      return;
    }
    if (response.type === "shoal.errors.SerializationError") {
      // the holder cannot send one of the values in a neutral encoding: ask for each
      // key alone to learn which
      if (items.length > 1) {
        for (const item of items) this.getData(holder, [item]);
        return;
      }
      items[0].resolve({
        error: { name: "SerializationError", message: String(response.message), stack: tracebackOf(response) },
      });
      return;
    }
    process.stderr.write(`shoal-worker: get-data from ${holder}: ${response.type}: ${response.message}\n`);
    this.retry(holder, items, true);
  }

  /** One request and its response (a map with `status`) on a pooled connection. */
  async request(address, msg) {
    const conn = await this.connection(address);
    try {
      conn.send(encodeMessage(msg));
      for (;;) {
        const reply = decodeMessage(await conn.recv(REQUEST_TIMEOUT));
        if (isMap(reply) && reply.op === "shoal-lease-ack") continue; // §4.8: not a response
        if (!isMap(reply) || !("status" in reply)) throw new Error("a response that is not a map with status");
        this.release(address, conn);
        return reply;
      }
    } catch (err) {
      conn.close();
      throw err;
    }
  }

  async connection(address) {
    const idle = this.idle.get(address);
    while (idle && idle.length) {
      const conn = idle.pop();
      clearTimeout(conn.idleClose);
      if (!conn.closed) return conn;
    }
    // a holder out of descriptors or memory drops connections in their handshake:
    // that, and running out here, is tried again (§7.2); other failures are not
    for (let attempt = 1, delay = 100; ; attempt++, delay = Math.min(2 * delay, 2000)) {
      try {
        const conn = await connect(address, CONNECT_TIMEOUT);
        await handshake(conn, { secret: this.worker.secret, connector: true, host: this.worker.host });
        return conn;
      } catch (err) {
        const lacking = RESOURCE_ERRORS.has(err.code) || /ECONNRESET|connection closed|EMFILE|ENFILE/.test(err.message);
        if (!lacking || attempt >= ATTEMPTS) throw err;
        await new Promise((resolve) => setTimeout(resolve, delay));
      }
    }
  }

  release(address, conn) {
    if (this.closed || conn.closed) return conn.close();
    if (!this.idle.has(address)) this.idle.set(address, []);
    this.idle.get(address).push(conn);
    conn.idleClose = setTimeout(() => {
      const list = this.idle.get(address) ?? [];
      const i = list.indexOf(conn);
      if (i >= 0) list.splice(i, 1);
      conn.close();
    }, IDLE_CLOSE);
    conn.idleClose.unref();
  }

  close() {
    this.closed = true;
    for (const list of this.idle.values()) for (const conn of list.splice(0)) conn.close();
  }
}

/** What a holder sent for a key, as the task thread takes it. */
function entryOf(depId, value) {
  if (!(value instanceof OOB)) return { entry: { family: "inline", header: {}, frames: [], value: untuple(value) } };
  if (value.family === "pickle" || (value.family === "bytes" && value.header.kind === "pickle")) {
    const key = JSON.stringify(String(untuple(keyFromId(depId))));
    const message = `the value of ${key} is a pickled Python object: a js worker reads only language-neutral values`;
    return { error: { name: "SerializationError", message, stack: `SerializationError: ${message}` } };
  }
  return { entry: { family: value.family, header: value.header, frames: value.frames } };
}

function tracebackOf(response) {
  const tb = typeof response.traceback === "string" ? response.traceback : "";
  return tb || `SerializationError: ${response.message}`;
}

module.exports = { Fetcher };
