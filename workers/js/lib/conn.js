"use strict";
// Framing (docs/protocol.md §2) on a TCP socket: a Conn reads whole messages (arrays
// of frames) within the limits of §2.2 and writes each message's bytes contiguously.
// Bad input aborts that connection only (§2.3): it is logged and the socket destroyed.

const crypto = require("node:crypto");
const net = require("node:net");
const { constants: bufferConstants } = require("node:buffer");

const MB = 1 << 20;

function envInt(name, fallback) {
  const text = process.env[name];
  if (text === undefined || text === "") return fallback;
  const n = Number(text);
  return Number.isFinite(n) && n > 0 ? n : fallback;
}

/** §2.2; a frame is also bounded by the largest Buffer this Node.js can make. */
const LIMITS = {
  maxFrames: envInt("SHOAL_MAX_FRAMES", 2 ** 20),
  maxFrameBytes: Math.min(envInt("SHOAL_MAX_FRAME_BYTES", 2 ** 36), bufferConstants.MAX_LENGTH),
  maxMessageBytes: envInt("SHOAL_MAX_MESSAGE_BYTES", 2 ** 36),
  partialTimeout: envInt("SHOAL_PARTIAL_MESSAGE_TIMEOUT", 30) * 1000,
  idleTimeout: envInt("SHOAL_IDLE_TIMEOUT", 300) * 1000,
};

/**
 * Before the handshake is done: one frame of at most 4096 bytes, two messages (§3);
 * the third (step 3) is read once the session, if any, is set up.
 */
const STRANGER = { maxFrames: 1, maxFrameBytes: 4096, maxMessages: 2 };

const TAG_BYTES = 16;
const LARGE_FRAME = 65536;
const TAG_PIECE = 1 << 20;

/**
 * The tags of one direction of a connection with a session (§2.5): HMAC-SHA256 under
 * the direction's key over the sequence number and the message as tagged (a frame of
 * 64 KiB or more enters as the SHA-256 of its 1 MiB pieces' SHA-256s), cut to 16 bytes.
 */
class Tagger {
  constructor(key) {
    this.key = key;
    this.seq = 0n;
  }

  tag(head, frames) {
    const h = crypto.createHmac("sha256", this.key);
    const seq = Buffer.allocUnsafe(8);
    seq.writeBigUInt64LE(this.seq++, 0);
    h.update(seq);
    h.update(head);
    for (const f of frames) {
      const bytes = Buffer.from(f.buffer, f.byteOffset, f.byteLength);
      if (bytes.length < LARGE_FRAME) {
        h.update(bytes);
        continue;
      }
      const pieces = [];
      for (let i = 0; i < bytes.length; i += TAG_PIECE)
        pieces.push(crypto.createHash("sha256").update(bytes.subarray(i, i + TAG_PIECE)).digest());
      h.update(crypto.createHash("sha256").update(Buffer.concat(pieces)).digest());
    }
    return h.digest().subarray(0, TAG_BYTES);
  }
}

class ConnClosed extends Error {
  get name() {
    return "ConnClosed";
  }
}

function log(text) {
  process.stderr.write(`shoal-worker: ${text}\n`);
}

/**
 * Reads the byte layout of §2.1 incrementally. Each frame gets a buffer of its own
 * when its turn comes (so large frames start at offset 0 of their own ArrayBuffer).
 */
class FrameParser {
  constructor(onMessage, onError) {
    this.onMessage = onMessage;
    this.onError = onError;
    this.chunks = [];
    this.buffered = 0;
    this.stage = "count"; // count | lengths | frames
    this.n = 0;
    this.lengths = null;
    this.frames = null;
    this.current = null; // the frame being filled
    this.filled = 0;
    this.stranger = true;
    this.strangerMessages = 0;
    this.strangerMost = STRANGER.maxMessages;
    this.head = null; // the count and lengths of the message coming in
    this.tagger = null; // the session's, for what the peer sends (§2.5)
  }

  /** Whether a message has started and not ended. */
  get midMessage() {
    return this.stage !== "count" || this.buffered > 0;
  }

  push(chunk) {
    this.chunks.push(chunk);
    this.buffered += chunk.length;
    try {
      this.drain();
    } catch (err) {
      this.onError(err);
    }
  }

  take(n) {
    // the first n buffered bytes, as one Buffer
    const out = Buffer.allocUnsafe(n);
    let got = 0;
    while (got < n) {
      const head = this.chunks[0];
      const k = Math.min(head.length, n - got);
      head.copy(out, got, 0, k);
      got += k;
      if (k === head.length) this.chunks.shift();
      else this.chunks[0] = head.subarray(k);
    }
    this.buffered -= n;
    return out;
  }

  drain() {
    for (;;) {
      if (this.stage === "count") {
        // nothing after a stranger's three handshake messages is read until it is trusted
        if (this.stranger && this.strangerMessages >= this.strangerMost) return;
        if (this.buffered < 8) return;
        const count = this.take(8);
        const n = count.readBigUInt64LE(0);
        const most = this.stranger ? STRANGER.maxFrames : LIMITS.maxFrames;
        if (n === 0n || n > BigInt(most)) throw new Error(`message announces ${n} frames (1 to ${most})`);
        this.n = Number(n);
        this.head = count;
        this.stage = "lengths";
      }
      if (this.stage === "lengths") {
        if (this.buffered < 8 * this.n) return;
        const raw = this.take(8 * this.n);
        this.head = Buffer.concat([this.head, raw]);
        const most = this.stranger ? STRANGER.maxFrameBytes : LIMITS.maxFrameBytes;
        const lengths = [];
        let total = 0n;
        for (let i = 0; i < this.n; i++) {
          const len = raw.readBigUInt64LE(8 * i);
          if (len > BigInt(most)) throw new Error(`frame length ${len} exceeds the maximum ${most}`);
          total += len;
          lengths.push(Number(len));
        }
        if (total > BigInt(LIMITS.maxMessageBytes))
          throw new Error(`message of ${total} bytes exceeds ${LIMITS.maxMessageBytes}`);
        if (lengths[0] === 0) throw new Error("malformed message header: empty");
        this.lengths = lengths;
        this.frames = [];
        this.stage = "frames";
      }
      if (this.stage === "frames") {
        while (this.frames.length < this.n) {
          const len = this.lengths[this.frames.length];
          if (len === 0) {
            this.frames.push(Buffer.alloc(0));
            continue;
          }
          if (this.current === null) {
            if (this.buffered === 0) return;
            // allocated when the frame's first bytes arrive, not when it is announced
            try {
              this.current = Buffer.allocUnsafeSlow(len);
            } catch {
              throw new Error(`cannot allocate ${len} bytes for a frame the peer announced`);
            }
            this.filled = 0;
          }
          while (this.filled < len && this.chunks.length) {
            const head = this.chunks[0];
            const k = Math.min(head.length, len - this.filled);
            head.copy(this.current, this.filled, 0, k);
            this.filled += k;
            this.buffered -= k;
            if (k === head.length) this.chunks.shift();
            else this.chunks[0] = head.subarray(k);
          }
          if (this.filled < len) return;
          this.frames.push(this.current);
          this.current = null;
        }
        if (this.tagger !== null) this.stage = "tag";
      }
      if (this.stage === "tag") {
        if (this.buffered < TAG_BYTES) return;
        const got = this.take(TAG_BYTES);
        if (!crypto.timingSafeEqual(got, this.tagger.tag(this.head, this.frames)))
          throw new Error("a message does not match its session tag (changed on its way, or not from the peer)");
      }
      {
        const frames = this.frames;
        this.stage = "count";
        this.frames = null;
        this.lengths = null;
        if (this.stranger) this.strangerMessages++;
        this.onMessage(frames);
      }
    }
  }
}

/** One TCP connection carrying shoal messages. */
class Conn {
  constructor(socket, label) {
    this.socket = socket;
    this.label = label;
    this.queue = [];
    this.waiters = [];
    this.closed = false;
    this.error = null;
    this.partialTimer = null;
    this.sendTagger = null; // the session's, for what we send (§2.5)
    this.parser = new FrameParser(
      (frames) => this.deliver(frames),
      (err) => this.abort(err.message),
    );
    socket.setNoDelay(true);
    socket.on("data", (chunk) => {
      this.parser.push(chunk);
      // a stranger's bytes beyond its handshake wait in the socket, not here
      if (this.parser.stranger && this.parser.buffered > 65536) socket.pause();
      this.watchPartial();
    });
    socket.on("error", (err) => this.ended(err));
    socket.on("close", () => this.ended(null));
    socket.on("end", () => {
      if (this.parser.midMessage) log(`${this.label}: peer closed in the middle of a message`);
      socket.end();
    });
  }

  /**
   * Steps 1 and 2 are done: from step 3 on, messages carry tags under `keys`
   * ({send, receive}, or null without a session), and the step-3 message is read.
   */
  startSession(keys) {
    if (keys) {
      this.sendTagger = new Tagger(keys.send);
      this.parser.tagger = new Tagger(keys.receive);
    }
    this.parser.strangerMost = STRANGER.maxMessages + 1;
    this.parser.push(Buffer.alloc(0));
    this.socket.resume();
  }

  /** The handshake is done: ordinary limits from now on. */
  trusted() {
    this.parser.stranger = false;
    this.parser.push(Buffer.alloc(0));
    this.socket.resume();
  }

  watchPartial() {
    if (this.partialTimer) clearTimeout(this.partialTimer);
    this.partialTimer = null;
    if (this.parser.midMessage && !this.closed) {
      this.partialTimer = setTimeout(
        () => this.abort("the peer stopped in the middle of a message"),
        LIMITS.partialTimeout,
      );
      this.partialTimer.unref();
    }
  }

  deliver(frames) {
    if (this.closed) return;
    const waiter = this.waiters.shift();
    if (waiter) waiter.resolve(frames);
    else this.queue.push(frames);
  }

  /**
   * The next message's frames. Rejects with ConnClosed when the connection ends
   * first, or with an Error after `timeoutMs` (then the connection is closed).
   */
  recv(timeoutMs = 0) {
    if (this.queue.length) return Promise.resolve(this.queue.shift());
    if (this.closed) return Promise.reject(this.error ?? new ConnClosed(`${this.label}: connection closed`));
    return new Promise((resolve, reject) => {
      const waiter = { resolve, reject, timer: null };
      if (timeoutMs > 0) {
        waiter.timer = setTimeout(() => {
          this.waiters.splice(this.waiters.indexOf(waiter), 1);
          this.close();
          reject(new Error(`${this.label}: nothing arrived within ${timeoutMs / 1000} s`));
        }, timeoutMs);
      }
      const done = (fn) => (v) => {
        if (waiter.timer) clearTimeout(waiter.timer);
        fn(v);
      };
      waiter.resolve = done(resolve);
      waiter.reject = done(reject);
      this.waiters.push(waiter);
    });
  }

  /** Writes one message; its bytes are contiguous on the stream (one event-loop turn). */
  send(frames) {
    if (this.closed) throw this.error ?? new ConnClosed(`${this.label}: connection closed`);
    const head = Buffer.allocUnsafe(8 * (frames.length + 1));
    head.writeBigUInt64LE(BigInt(frames.length), 0);
    frames.forEach((f, i) => head.writeBigUInt64LE(BigInt(f.byteLength), 8 * (i + 1)));
    this.socket.cork();
    this.socket.write(head);
    for (const f of frames) if (f.byteLength) this.socket.write(f);
    if (this.sendTagger) this.socket.write(this.sendTagger.tag(head, frames));
    this.socket.uncork();
  }

  /** Bad input: logged, the connection closed at once without a reply (§2.3). */
  abort(reason) {
    if (this.closed) return;
    log(`${this.label}: ${reason}; connection aborted`);
    this.ended(new ConnClosed(`${this.label}: ${reason}`));
    this.socket.destroy();
  }

  close() {
    if (!this.closed) this.ended(null);
    this.socket.end();
    this.socket.destroySoon?.();
    setTimeout(() => this.socket.destroy(), 1000).unref();
  }

  ended(err) {
    if (this.closed) return;
    this.closed = true;
    this.error =
      err instanceof Error && !(err instanceof ConnClosed) ? new ConnClosed(`${this.label}: ${err.message}`) : err;
    if (this.partialTimer) clearTimeout(this.partialTimer);
    const error = this.error ?? new ConnClosed(`${this.label}: connection closed`);
    for (const w of this.waiters.splice(0)) w.reject(error);
  }
}

/** `tcp://host:port` (or `host:port`, `tcp://[v6]:port`) -> [host, port]. */
function parseAddress(address) {
  const rest = address.startsWith("tcp://") ? address.slice(6) : address;
  const m = /^\[([^\]]+)\]:(\d+)$/.exec(rest) ?? /^([^:/]+):(\d+)$/.exec(rest);
  if (!m) throw new Error(`not a tcp address: ${JSON.stringify(address)}`);
  return [m[1], Number(m[2])];
}

function formatAddress(host, port) {
  return host.includes(":") ? `tcp://[${host}]:${port}` : `tcp://${host}:${port}`;
}

/** A connected Conn to `address` (not yet handshaken); rejects after `timeoutMs`. */
function connect(address, timeoutMs) {
  const [host, port] = parseAddress(address);
  return new Promise((resolve, reject) => {
    const socket = net.connect({ host, port });
    const timer = setTimeout(() => {
      socket.destroy();
      reject(new Error(`connecting to ${address} timed out`));
    }, timeoutMs);
    socket.once("connect", () => {
      clearTimeout(timer);
      socket.removeAllListeners("error");
      resolve(new Conn(socket, address));
    });
    socket.once("error", (err) => {
      clearTimeout(timer);
      reject(err);
    });
  });
}

module.exports = { Conn, ConnClosed, LIMITS, MB, Tagger, connect, formatAddress, log, parseAddress };
