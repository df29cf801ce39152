"use strict";
// The handshake (docs/protocol.md §3) and where the secret comes from (§3.1).
// This worker has no shared-memory data plane: it offers no probe, answers
// "can_map": false, and says "reads": "neutral" (it decodes only language-neutral
// encodings), so that Python peers send it `shoal.value`, `shoal.array`, `bytes`.

const crypto = require("node:crypto");
const fs = require("node:fs");
const os = require("node:os");
const path = require("node:path");
const { decodeStranger, encodeMessage } = require("./codec");
const { parseAddress } = require("./conn");

const PROTOCOL = 5;
const STEP_TIMEOUT = 10_000; // §3: 10 s per read

class HandshakeError extends Error {
  get name() {
    return "HandshakeError";
  }
}

/** This host's identity as Python processes write it (§3): hostname, boot id, device of /dev/shm. */
function hostIdentity() {
  let boot = "";
  try {
    boot = fs.readFileSync("/proc/sys/kernel/random/boot_id", "utf8").trim();
  } catch {
    // no boot id on this system: the part stays empty
  }
  let shmDev = "";
  try {
    shmDev = fs.statSync("/dev/shm").dev.toString(16);
  } catch {
    // no /dev/shm: the part stays empty
  }
  return `${os.hostname()}/${boot}/${shmDev}`;
}

/**
 * The cluster's secret as bytes, or null for none (§3.1): SHOAL_AUTH, then the file
 * `authFile` or SHOAL_AUTH_FILE, then the auth file of a scheduler on this host.
 * Throws for an auth file other users may read.
 */
function findSecret(schedulerAddress, authFile) {
  if (process.env.SHOAL_AUTH) return Buffer.from(process.env.SHOAL_AUTH.trim(), "utf8");
  let file = authFile || process.env.SHOAL_AUTH_FILE;
  if (!file) {
    const dir = process.env.SHOAL_AUTH_DIR || path.join(os.homedir(), ".shoal", "auth");
    file = path.join(dir, `port-${parseAddress(schedulerAddress)[1]}`);
    if (!fs.existsSync(file)) return null;
  }
  const stat = fs.statSync(file);
  if (stat.mode & 0o077)
    throw new HandshakeError(
      `the auth file ${file} may be read by other users (mode ${(stat.mode & 0o777).toString(8)})`,
    );
  const secret = fs.readFileSync(file, "utf8").trim();
  return secret ? Buffer.from(secret, "utf8") : null;
}

function proofOf(secret, role, nonceC, nonceA) {
  const bar = Buffer.from("|");
  return crypto
    .createHmac("sha256", secret)
    .update(Buffer.concat([Buffer.from("shoal-auth-1"), bar, Buffer.from(role), bar, nonceC, bar, nonceA]))
    .digest();
}

/** §2.5: the keys of both directions, from the secret and steps 1 and 2's bytes. */
function sessionKeys(secret, transcript, connector) {
  const hmac = (key, data) => crypto.createHmac("sha256", key).update(data).digest();
  const digest = crypto.createHash("sha256").update(Buffer.concat(transcript.flatMap(lengthThen))).digest();
  const prk = hmac(secret, Buffer.concat([Buffer.from("shoal-session-1|"), digest]));
  const byConnector = hmac(prk, Buffer.from("connector"));
  const byAcceptor = hmac(prk, Buffer.from("acceptor"));
  return connector ? { send: byConnector, receive: byAcceptor } : { send: byAcceptor, receive: byConnector };
}

function lengthThen(bytes) {
  const n = Buffer.allocUnsafe(8);
  n.writeBigUInt64LE(BigInt(bytes.length), 0);
  return [n, Buffer.from(bytes)];
}

async function step(conn, op, raw = null) {
  let msg;
  try {
    const frames = await conn.recv(STEP_TIMEOUT);
    if (raw) raw.push(frames[0]);
    msg = decodeStranger(frames);
  } catch (err) {
    conn.close();
    throw new HandshakeError(`handshake with ${conn.label}: ${err.message}`);
  }
  if (msg.op === "handshake-refused") {
    conn.close();
    throw new HandshakeError(`${conn.label} refused the handshake: ${msg.reason}`);
  }
  if (msg.op !== op) {
    conn.close();
    throw new HandshakeError(`handshake with ${conn.label}: expected ${op}, got ${String(msg.op).slice(0, 40)}`);
  }
  return msg;
}

function refuse(conn, reason) {
  try {
    conn.send(encodeMessage({ op: "handshake-refused", reason, protocol: PROTOCOL }));
  } finally {
    conn.close();
  }
  throw new HandshakeError(`handshake with ${conn.label} refused: ${reason}`);
}

/**
 * All three steps on `conn`, as the end that opened it (`connector`) or accepted it;
 * with a secret, the session's tags (§2.5) from step 3 on. `expect`: the role the
 * peer must say it is ("scheduler" when we dial ours). Resolves once done (the
 * connection then has ordinary limits); rejects with HandshakeError, the connection
 * closed.
 */
async function handshake(conn, { secret, connector, host, expect = null }) {
  const nonce = crypto.randomBytes(32);
  const sent = [];
  const got = [];
  const send = (msg) => {
    const frames = encodeMessage(msg);
    sent.push(frames[0]);
    conn.send(frames);
  };
  send({ op: "handshake", protocol: PROTOCOL, nonce, auth: secret !== null });
  const hello = await step(conn, "handshake", got);
  if (hello.protocol !== PROTOCOL)
    refuse(conn, `protocol ${hello.protocol} is not ${PROTOCOL} (this end speaks ${PROTOCOL})`);
  if (!(hello.nonce instanceof Uint8Array) || hello.nonce.length !== 32) refuse(conn, "the nonce is not 32 bytes");
  if (Boolean(hello.auth) !== (secret !== null)) {
    refuse(
      conn,
      secret !== null
        ? "authentication required: this end has the cluster's secret"
        : "this end has no secret; the peer requires one",
    );
  }
  const theirs = Buffer.from(hello.nonce);
  const [nonceC, nonceA] = connector ? [nonce, theirs] : [theirs, nonce];
  const proof = secret !== null ? proofOf(secret, connector ? "connector" : "acceptor", nonceC, nonceA) : null;
  send({ op: "handshake-auth", proof, pid: process.pid, host, role: "worker", reads: "neutral" });
  const auth = await step(conn, "handshake-auth", got);
  if (secret !== null) {
    const expected = proofOf(secret, connector ? "acceptor" : "connector", nonceC, nonceA);
    const theirs = auth.proof instanceof Uint8Array ? Buffer.from(auth.proof) : Buffer.alloc(0);
    if (theirs.length !== expected.length || !crypto.timingSafeEqual(theirs, expected)) {
      refuse(conn, "authentication failed: wrong proof of the cluster's secret");
    }
  }
  const transcript = connector ? [sent[0], got[0], sent[1], got[1]] : [got[0], sent[0], got[1], sent[1]];
  conn.startSession(secret !== null ? sessionKeys(secret, transcript, connector) : null);
  if (expect !== null && auth.role !== expect)
    refuse(conn, `this end meant to reach a ${expect} and the peer says it is ${JSON.stringify(auth.role)}`);
  conn.send(encodeMessage({ op: "handshake-shm", can_map: false }));
  await step(conn, "handshake-shm");
  conn.trusted();
  return auth;
}

module.exports = { HandshakeError, findSecret, handshake, hostIdentity, proofOf, sessionKeys };
