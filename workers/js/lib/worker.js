"use strict";
// The worker's main thread (docs/protocol.md §7, §8, §10): the scheduler stream,
// the listener that serves get-data, fetching dependencies from peers, and handing
// tasks to the thread pool. It decodes message headers only; payloads and values
// stay bytes here and are decoded and encoded in the task threads.

const net = require("node:net");
const os = require("node:os");
const { OOB, ProtocolError, decodeMessage, encodeMessage, getDataResponse, keyFromId, keyId } = require("./codec");
const { Conn, LIMITS, connect, formatAddress, log } = require("./conn");
const { findSecret, handshake, hostIdentity } = require("./handshake");
const { Fetcher } = require("./fetch");
const { ThreadPool } = require("./pool");

const HEARTBEAT_IDLE = 2000; // send a heartbeat after this long without sending anything (ms)
const CONNECT_TIMEOUT = 30_000;
const MAX_HANDSHAKING = 256; // §3: strangers in their handshake at once
const MAX_HANDSHAKING_PER_HOST = 128;

function isMap(v) {
  return v !== null && typeof v === "object" && !Array.isArray(v) && !(v instanceof Uint8Array) && !(v instanceof OOB);
}

/** A copy of each frame in a buffer of its own, and those buffers (to transfer). */
function copyOnce(frames) {
  const out = frames.map((f) => Uint8Array.prototype.slice.call(f));
  return [out, out.map((f) => f.buffer)];
}

class JsWorker {
  /**
   * `options`: scheduler (address), nthreads, path (directories of task modules),
   * name, listenHost, authFile, noAuth.
   */
  constructor(options) {
    this.options = options;
    this.nthreads = options.nthreads;
    this.name = options.name ?? "";
    this.host = hostIdentity();
    this.secret = options.noAuth ? null : findSecret(options.scheduler, options.authFile);
    this.data = new Map(); // key id -> {key, frames, nbytes, type}: this worker's results
    this.tasks = new Map(); // key id -> task (waiting for inputs, ready, or running)
    this.ready = []; // tasks whose inputs are here, by priority
    this.seq = 0;
    this.outbox = [];
    this.flushing = false;
    this.lastSent = Date.now();
    this.stream = null;
    this.server = null;
    this.address = "";
    this.stopping = false;
    this.leaving = false;
    this.handshaking = new Map(); // peer host -> connections from it in their handshake
    this.handshakingTotal = 0;
    this.pool = new ThreadPool(this.nthreads, options.path, log);
    this.pool.onIdle = () => this.pump();
    this.fetcher = new Fetcher(this);
  }

  // -- life cycle (§10) ------------------------------------------------------------

  async start() {
    const stream = await connect(this.options.scheduler, CONNECT_TIMEOUT);
    stream.label = `scheduler ${this.options.scheduler}`;
    await handshake(stream, { secret: this.secret, connector: true, host: this.host, expect: "scheduler" });
    const listenHost = this.options.listenHost ?? stream.socket.localAddress;
    const port = await this.listen(listenHost);
    const advertised = listenHost === "0.0.0.0" || listenHost === "::" ? stream.socket.localAddress : listenHost;
    this.address = formatAddress(advertised, port);
    stream.send(
      encodeMessage({
        op: "register-worker",
        address: this.address,
        nthreads: this.nthreads,
        host: this.host,
        pid: process.pid,
        name: this.name || this.address,
        languages: ["js"],
        // of the optional ops (§8.2), the ones served here: clients then scatter,
        // run and ask transfer-stats only of the workers that serve them
        ops: ["identity", "has-keys"],
      }),
    );
    const reply = decodeMessage(await stream.recv(CONNECT_TIMEOUT));
    if (!isMap(reply) || reply.status !== "OK") {
      stream.close();
      throw new Error(`the scheduler refused the registration: ${isMap(reply) ? reply.message : "no reply"}`);
    }
    this.stream = stream;
    this.heartbeats = setInterval(() => {
      if (Date.now() - this.lastSent >= HEARTBEAT_IDLE) this.send({ op: "heartbeat" });
    }, 500);
    this.readStream().catch((err) => log(`the scheduler stream: ${err.message}`));
    return this.address;
  }

  listen(host) {
    return new Promise((resolve, reject) => {
      const server = net.createServer((socket) => this.serve(socket));
      server.maxConnections = 8192; // §3
      server.once("error", reject);
      server.listen({ host, port: 0 }, () => {
        server.removeListener("error", reject);
        server.on("error", (err) => log(`listener: ${err.message}`));
        this.server = server;
        resolve(server.address().port);
      });
    });
  }

  /** Leaves cleanly (SIGTERM, SIGINT): unregister, then wait for the scheduler to close. */
  async leave() {
    if (this.stopping || !this.stream) return this.stop(0);
    this.leaving = true;
    this.send({ op: "unregister" });
    this.flush();
    const closed = new Promise((resolve) => this.stream.socket.once("close", resolve));
    const timeout = new Promise((resolve) => setTimeout(resolve, 5000).unref());
    await Promise.race([closed, timeout]);
    return this.stop(0);
  }

  async stop(code) {
    if (this.stopping) return;
    this.stopping = true;
    clearInterval(this.heartbeats);
    this.server?.close();
    this.fetcher.close();
    this.stream?.close();
    await this.pool.close().catch(() => {});
    process.exitCode = code;
    process.exit(code);
  }

  // -- the scheduler stream (§6, §7.2, §7.3) -----------------------------------------

  send(op) {
    this.outbox.push(op);
    if (!this.flushing) {
      this.flushing = true;
      setImmediate(() => this.flush());
    }
  }

  flush() {
    this.flushing = false;
    if (!this.outbox.length || !this.stream || this.stream.closed) return;
    const batch = this.outbox.splice(0);
    this.stream.send(encodeMessage(batch));
    this.lastSent = Date.now();
  }

  async readStream() {
    const stream = this.stream;
    for (;;) {
      let frames;
      try {
        frames = await stream.recv();
      } catch (err) {
        if (this.stopping || this.leaving) return this.stop(0);
        log(`the scheduler stream ended (${err.message}); stopping`);
        return this.stop(1);
      }
      let msg;
      try {
        msg = decodeMessage(frames);
      } catch (err) {
        stream.abort(`a malformed message from the scheduler: ${err.message}`);
        return this.stop(1);
      }
      for (const op of Array.isArray(msg) ? msg : [msg]) {
        if (!isMap(op)) continue;
        try {
          if (op.op === "compute-task") this.computeTask(op);
          else if (op.op === "free-keys") this.freeKeys(op.keys);
          else if (op.op === "close") return this.stop(0);
          // anything else (shoal-lease-ack, plugin-add, ops of later versions) is ignored
        } catch (err) {
          log(`a ${op.op} the worker could not handle: ${err.message}`);
        }
      }
    }
  }

  computeTask(msg) {
    const key = msg.key;
    const id = keyId(key);
    if (this.data.has(id)) {
      this.send(this.finishedMsg(id));
      return;
    }
    if (this.tasks.has(id)) return; // queued or running already
    const priority = Array.isArray(msg.priority) ? msg.priority.map(Number) : [];
    const task = { id, key, payload: msg.payload, priority, seq: ++this.seq, deps: new Map(), state: "fetching" };
    this.tasks.set(id, task);
    const whoHas = isMap(msg.who_has) ? msg.who_has : {};
    const nbytes = isMap(msg.nbytes) ? msg.nbytes : {};
    const wanted = [];
    for (const [depId, holders] of Object.entries(whoHas)) {
      const held = this.data.get(depId);
      if (held) task.deps.set(depId, { family: "shoal.value", header: {}, frames: held.frames });
      else wanted.push([depId, Array.isArray(holders) ? holders.filter((h) => typeof h === "string") : []]);
    }
    if (!wanted.length) {
      this.makeReady(task);
      return;
    }
    Promise.all(wanted.map(([depId, holders]) => this.fetcher.fetch(depId, holders, Number(nbytes[depId]) || 0)))
      .then((results) => this.gathered(task, wanted, results))
      .catch((err) => this.erred(task, { name: "Error", message: err.message, stack: String(err.stack) }));
  }

  gathered(task, wanted, results) {
    if (this.tasks.get(task.id) !== task) return; // freed meanwhile
    const missing = [];
    for (let i = 0; i < wanted.length; i++) {
      const [depId, holders] = wanted[i];
      const r = results[i];
      if (r.error) {
        this.erred(task, r.error);
        return;
      }
      if (r.missing) missing.push([depId, holders]);
      else task.deps.set(depId, r.entry);
    }
    if (missing.length) {
      // §7.2: neither here nor with any other holder: give the task back
      for (const [depId, holders] of missing) {
        if (holders.includes(this.address))
          this.send({ op: "missing-data", key: keyFromId(depId), errant_worker: this.address });
      }
      this.tasks.delete(task.id);
      this.send({ op: "reschedule", key: task.key });
      return;
    }
    this.makeReady(task);
  }

  makeReady(task) {
    task.state = "ready";
    this.ready.push(task);
    this.ready.sort((a, b) => comparePriority(a.priority, b.priority) || a.seq - b.seq);
    this.pump();
  }

  /** Starts ready tasks on idle threads. */
  pump() {
    for (;;) {
      if (this.stopping || !this.ready.length) return;
      const thread = this.pool.idle();
      if (thread === null) return;
      const task = this.ready.shift();
      if (this.tasks.get(task.id) !== task) continue;
      this.runTask(task, thread);
    }
  }

  runTask(task, thread) {
    task.state = "running";
    const payload = task.payload;
    if (!(payload instanceof OOB) || payload.family !== "shoal.call" || payload.header.language !== "js") {
      const what =
        payload instanceof OOB
          ? `family '${payload.family}', language ${JSON.stringify(payload.header.language)}`
          : "no payload";
      this.erred(task, serializationError(`a js worker runs shoal.call payloads of language 'js', got ${what}`));
      return;
    }
    const transfer = [];
    const [frames, t1] = copyOnce(payload.frames);
    transfer.push(...t1);
    const deps = [];
    for (const [depId, entry] of task.deps) {
      if (entry.family === "inline") {
        deps.push([depId, entry]);
        continue;
      }
      const [depFrames, t2] = copyOnce(entry.frames);
      transfer.push(...t2);
      deps.push([depId, { family: entry.family, header: entry.header, frames: depFrames }]);
    }
    const message = {
      id: task.seq,
      module: String(payload.header.module),
      function: String(payload.header.function),
      header: payload.header,
      frames,
      deps,
    };
    task.deps = null; // the thread has them now
    this.pool.run(thread, message, transfer).then(
      (result) => this.taskDone(task, thread.number, result),
      (err) =>
        this.taskDone(task, thread.number, {
          ok: false,
          error: { name: "Error", message: err.message, stack: String(err.stack) },
        }),
    );
  }

  taskDone(task, threadNumber, result) {
    setImmediate(() => this.pump());
    if (this.tasks.get(task.id) !== task) return; // freed while it ran: the result is dropped
    if (!result.ok) {
      this.erred(task, result.error);
      return;
    }
    this.tasks.delete(task.id);
    this.data.set(task.id, { key: task.key, frames: result.frames, nbytes: result.nbytes, type: result.type });
    this.send({
      ...this.finishedMsg(task.id),
      duration: Math.max(0, result.stop - result.start),
      timing: [result.start, result.stop, threadNumber],
    });
  }

  finishedMsg(id) {
    const held = this.data.get(id);
    return { op: "task-finished", key: held.key, nbytes: held.nbytes, type: held.type };
  }

  erred(task, error) {
    if (this.tasks.get(task.id) !== task) return;
    this.tasks.delete(task.id);
    const msg = {
      op: "task-erred",
      key: task.key,
      exception: null,
      traceback: String(error.stack || `${error.name}: ${error.message}`),
      text: `${error.name}: ${error.message}`,
    };
    this.send(msg);
  }

  freeKeys(keys) {
    if (!Array.isArray(keys)) return;
    for (const key of keys) {
      let id;
      try {
        id = keyId(key);
      } catch {
        continue;
      }
      this.data.delete(id);
      // a queued or running task is forgotten: a result that comes later is dropped
      this.tasks.delete(id);
    }
  }

  // -- requests from clients and peers (§5, §8) -------------------------------------

  async serve(socket) {
    // strangers are limited (§3): so many in their handshake at once, fewer per host
    const peerHost = socket.remoteAddress ?? "";
    const fromHost = this.handshaking.get(peerHost) ?? 0;
    if (this.handshakingTotal >= MAX_HANDSHAKING || fromHost >= MAX_HANDSHAKING_PER_HOST) {
      socket.destroy();
      return;
    }
    this.handshakingTotal++;
    this.handshaking.set(peerHost, fromHost + 1);
    const conn = new Conn(socket, `peer ${peerHost}:${socket.remotePort}`);
    try {
      await handshake(conn, { secret: this.secret, connector: false, host: this.host });
    } catch (err) {
      log(err.message);
      return;
    } finally {
      this.handshakingTotal--;
      const left = this.handshaking.get(peerHost) - 1;
      if (left > 0) this.handshaking.set(peerHost, left);
      else this.handshaking.delete(peerHost);
    }
    for (;;) {
      let frames;
      try {
        frames = await conn.recv(LIMITS.idleTimeout);
      } catch {
        return; // closed, or idle too long (closed by recv)
      }
      let msg;
      try {
        msg = decodeMessage(frames);
      } catch (err) {
        conn.abort(`a malformed message: ${err.message}`);
        return;
      }
      if (!isMap(msg) || typeof msg.op !== "string") {
        conn.abort("a request that is not a map with a str op");
        return;
      }
      if (msg.op === "shoal-lease-ack") continue; // §4.8: not a request; we take no leases
      const reply = msg.reply !== false;
      let response;
      try {
        response = this.handle(msg);
      } catch (err) {
        const type = err instanceof ProtocolError ? "shoal.errors.ProtocolError" : (err.type ?? `builtins.${err.name}`);
        response = encodeMessage(errorResponse(type, err.message, err.stack));
      }
      if (response === null) {
        conn.abort(`no handler for op '${msg.op}' and no reply asked for`);
        return;
      }
      if (reply && !conn.closed) conn.send(response);
    }
  }

  /** The response frames of a request, or null for an unknown op. */
  handle(msg) {
    switch (msg.op) {
      case "get-data": {
        if (!Array.isArray(msg.keys)) throw new ProtocolError("malformed 'get-data': field 'keys' is not an array");
        const pairs = [];
        const seen = new Set();
        for (const key of msg.keys) {
          const id = keyId(key);
          const held = this.data.get(id);
          if (held && !seen.has(id)) {
            seen.add(id);
            pairs.push([id, new OOB("shoal.value", {}, held.frames, true)]);
          }
        }
        return getDataResponse(pairs);
      }
      case "has-keys": {
        // the scheduler asks whether we hold values peers say we did not serve (§7.3)
        if (!Array.isArray(msg.keys)) throw new ProtocolError("malformed 'has-keys': field 'keys' is not an array");
        return encodeMessage({ status: "OK", result: { held: msg.keys.filter((key) => this.data.has(keyId(key))) } });
      }
      case "identity":
        return encodeMessage({
          status: "OK",
          result: {
            type: "Worker",
            address: this.address,
            nthreads: this.nthreads,
            name: this.name || this.address,
            pid: process.pid,
            host: os.hostname(),
            languages: ["js"],
          },
        });
      default:
        if (msg.reply === false) return null;
        return encodeMessage(
          errorResponse("builtins.ValueError", `the js worker ${this.address} has no handler for op '${msg.op}'`, ""),
        );
    }
  }
}

function errorResponse(type, message, traceback) {
  return { status: "error", type, message: String(message), traceback: String(traceback ?? ""), exception: null };
}

function serializationError(message) {
  const err = new Error(message);
  return {
    name: "SerializationError",
    message,
    stack: `SerializationError: ${message}\n${err.stack.split("\n").slice(1).join("\n")}`,
  };
}

function comparePriority(a, b) {
  for (let i = 0; i < Math.max(a.length, b.length); i++) {
    const d = (a[i] ?? 0) - (b[i] ?? 0);
    if (d) return d;
  }
  return 0;
}

module.exports = { JsWorker };
