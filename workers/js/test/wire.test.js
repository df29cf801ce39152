"use strict";
// The codec and the value mapping against the byte-by-byte examples of
// docs/protocol.md §12, and the rules of §2 and §4. Run: npm test (node --test).

const assert = require("node:assert/strict");
const { test } = require("node:test");
const codec = require("../lib/codec");
const values = require("../lib/values");
const { Conn, Tagger } = require("../lib/conn");
const { proofOf, sessionKeys } = require("../lib/handshake");
const { Encoder, ExtData } = require("@msgpack/msgpack");

const hex = (s) => Buffer.from(s.replace(/\s+/g, ""), "hex");
const range = (a, b) => Buffer.from(Array.from({ length: b - a }, (_, i) => a + i));

test("§12.1: task-finished with a tuple key, byte for byte", () => {
  const frames = codec.encodeMessage({
    op: "task-finished",
    key: new codec.Tuple(["x", 1]),
    nbytes: 28,
    duration: 0.5,
  });
  assert.equal(frames.length, 1);
  assert.deepEqual(
    Buffer.from(frames[0]),
    hex(`84 a26f70 ad7461736b2d66696e6973686564 a36b6579 d60192a17801
    a66e6279746573 1c a86475726174696f6e cb3fe0000000000000`),
  );
  const back = codec.decodeMessage(frames);
  assert.ok(back.key instanceof codec.Tuple);
  assert.equal(codec.keyId(back.key), codec.keyId(new codec.Tuple(["x", 1])));
});

test("§12.2: a get-data response with an out-of-band value", () => {
  const header = hex("82 a6737461747573 a24f4b a6726573756c74 81 a464617461 81 a161 d60200000000");
  const table = hex("91 94 a67069636b6c65 80 01 c3");
  const msg = codec.decodeMessage([header, table, hex("80054b2a2e")]);
  const entry = msg.result.data.a;
  assert.ok(entry instanceof codec.OOB);
  assert.equal(entry.family, "pickle");
  assert.equal(entry.opaque, true);
  assert.deepEqual(Buffer.from(entry.frames[0]), hex("80054b2a2e"));
  // and ours has the same shape, with a tuple key
  const frames = codec.getDataResponse([
    [codec.keyId(new codec.Tuple(["a", 1])), new codec.OOB("shoal.value", {}, [hex("2a")])],
  ]);
  const ours = codec.decodeMessage(frames);
  assert.deepEqual(Object.keys(ours.result.data), [codec.keyId(new codec.Tuple(["a", 1]))]);
});

test("§12.3: the handshake proof", () => {
  const proof = proofOf(Buffer.from("example-secret"), "connector", range(0, 32), range(32, 64));
  assert.equal(proof.toString("hex"), "0f1e3c04fc0183d15fcb55fe6d3ca6596aa9ad1c02adfb9b8241b3617ebf624d");
  assert.deepEqual(
    Buffer.from(codec.encodeMessage({ op: "handshake-shm", can_map: false })[0]),
    hex("82 a26f70 ad68616e647368616b652d73686d a763616e5f6d6170 c2"),
  );
});

test("§12.3, §2.5: the session's keys and the tag of step 3", () => {
  const secret = Buffer.from("example-secret");
  const hello = (nonce) => codec.encodeMessage({ op: "handshake", protocol: 5, nonce, auth: true })[0];
  const auth = (side, pid, host, role) =>
    codec.encodeMessage({ op: "handshake-auth", proof: proofOf(secret, side, range(0, 32), range(32, 64)), pid, host, role })[0];
  const transcript = [hello(range(0, 32)), hello(range(32, 64)), auth("connector", 4242, "w1/", "worker"),
    auth("acceptor", 1, "s/", "scheduler")];
  assert.deepEqual(transcript.map((m) => m.length), [70, 70, 87, 87]);
  const keys = sessionKeys(secret, transcript, true);
  assert.equal(keys.send.toString("hex"), "c3d15a743e8cd26ea6173bf4b54eefa69021427fc2bebb134881fcbebe3af854");
  const step3 = Buffer.from(codec.encodeMessage({ op: "handshake-shm", can_map: false })[0]);
  const head = hex("0100000000000000 1b00000000000000");
  assert.equal(new Tagger(keys.send).tag(head, [step3]).toString("hex"), "827c78cbfe8233e5dac7eaf2fdc37e69");
});

test("§2.3, §4: malformed headers and tables are refused", () => {
  const bad = [
    [hex("c1")], // not msgpack
    [hex("8100")], // truncated
    [hex("80 80")], // trailing bytes
    [hex("d60500000000")], // ext 5
    [hex("d6ff00000000")], // ext -1 (a timestamp) too
    [hex("d60200000000")], // ext 2 without a table
    [hex("d60201000000"), hex("91 94 a162 80 00 c3")], // ext 2 beyond the table
    [hex("80"), hex("91 93 a162 80 00")], // an entry of 3
    [hex("80"), hex("91 94 a162 80 01 c3")], // the table names a frame not sent
    [hex("80"), hex("90"), hex("00")], // a frame the table does not name
  ];
  for (const frames of bad)
    assert.throws(() => codec.decodeMessage(frames), codec.ProtocolError, frames[0].toString("hex"));
  // tuples nested more than 32 deep
  let t = new codec.Tuple([1]);
  for (let i = 0; i < 33; i++) t = new codec.Tuple([t]);
  const deep = new Encoder({
    extensionCodec: {
      tryToEncode: (o) => (o instanceof codec.Tuple ? new ExtData(1, deepItems(o)) : null),
      decode: () => null,
    },
  });
  function deepItems(o) {
    return deep.encode(o.items);
  }
  assert.throws(() => codec.decodeMessage([deep.encode(t)]), /nested more than 32/);
});

test("§2.1: a message split anywhere is read whole; limits before the handshake", async () => {
  const { PassThrough } = require("node:stream");
  const socket = new PassThrough();
  socket.setNoDelay = () => {};
  socket.cork = socket.uncork = () => {};
  const conn = new Conn(socket, "test");
  conn.trusted();
  const frames = codec.encodeMessage({
    op: "x",
    data: new codec.OOB("bytes", { kind: "bytes" }, [Buffer.alloc(100_000, 7)]),
  });
  const wire = Buffer.concat([lengthsOf(frames), ...frames]);
  for (let i = 0; i < wire.length; i += 9973) socket.write(wire.subarray(i, i + 9973));
  const got = codec.decodeMessage(await conn.recv(1000));
  assert.equal(got.op, "x");
  assert.equal(got.data.frames[0].length, 100_000);
  assert.equal(got.data.frames[0].byteOffset, 0); // a large frame has a buffer of its own

  const stranger = new Conn(Object.assign(new PassThrough(), { setNoDelay() {}, destroy() {} }), "stranger");
  stranger.socket.write(Buffer.concat([lengthsOf([Buffer.alloc(5000)])]));
  await assert.rejects(stranger.recv(1000), /exceeds the maximum 4096/);
});

function lengthsOf(frames) {
  const head = Buffer.alloc(8 * (frames.length + 1));
  head.writeBigUInt64LE(BigInt(frames.length));
  frames.forEach((f, i) => head.writeBigUInt64LE(BigInt(f.byteLength), 8 * (i + 1)));
  return head;
}

test("keys: equal keys have equal ids, and ids give the keys back", () => {
  for (const key of [
    "a",
    1,
    -5,
    2 ** 40,
    2n ** 63n,
    1.5,
    new Uint8Array([1, 2]),
    new codec.Tuple(["x", new codec.Tuple([1, 2])]),
    "\0odd",
  ]) {
    const id = codec.keyId(key);
    assert.equal(codec.keyId(codec.keyFromId(id)), id);
  }
  assert.notEqual(codec.keyId(1), codec.keyId("1"));
  assert.throws(() => codec.keyId([1]), /not a task key/);
  assert.throws(() => codec.keyId(null), /not a task key/);
});

test("values: arrays, BigInt, bytes and refusals", () => {
  const { frames, nbytes } = values.encodeValue({
    f: new Float64Array([1, 2.5]),
    nd: { dtype: "<i2", shape: [2, 1], data: new Int16Array([3, -4]) },
    b: { dtype: "|b1", shape: [2], data: new Uint8Array([1, 0]) },
    u8: { dtype: "|u1", shape: [1], data: new Uint8Array([9]) },
    bytes: new Uint8Array([1, 2]),
    big: 2n ** 60n,
    unsafe: 2 ** 60,
    small: 7,
  });
  assert.equal(frames.length, 5);
  assert.equal(
    nbytes,
    frames.reduce((n, f) => n + f.byteLength, 0),
  );
  const back = values.decodeEntry({ family: "shoal.value", header: {}, frames });
  assert.deepEqual(back.f, { dtype: "<f8", shape: [2], data: new Float64Array([1, 2.5]) });
  assert.deepEqual(back.nd, { dtype: "<i2", shape: [2, 1], data: new Int16Array([3, -4]) });
  assert.equal(back.b.dtype, "|b1");
  assert.equal(back.u8.dtype, "|u1");
  assert.ok(back.bytes instanceof Uint8Array && !("dtype" in back.bytes));
  assert.equal(back.big, 2n ** 60n); // beyond 2^53: BigInt
  assert.equal(back.unsafe, 2 ** 60); // a number that is no safe int travels as a float
  assert.equal(back.small, 7);
  // a frame at an odd offset is copied (a TypedArray cannot be misaligned); else a view
  const raw = Buffer.alloc(17);
  raw.writeDoubleLE(1.25, 1);
  raw.writeDoubleLE(-2, 9);
  const odd = values.decodeEntry({
    family: "shoal.array",
    header: { dtype: "<f8", shape: [2] },
    frames: [raw.subarray(1)],
  });
  assert.deepEqual([...odd.data], [1.25, -2]);
  const aligned = new Uint8Array(new ArrayBuffer(24), 8, 16);
  const view = values.decodeEntry({ family: "shoal.array", header: { dtype: "<f8", shape: [2] }, frames: [aligned] });
  assert.equal(view.data.buffer, aligned.buffer);
  for (const bad of [
    new Map(),
    new Set(),
    new Date(),
    () => 1,
    Symbol("s"),
    { x: new DataView(new ArrayBuffer(1)) },
    2n ** 64n,
    { dtype: "<f8", shape: [3], data: new Float64Array(2) },
    { dtype: "<f8", shape: [1], data: new Int32Array(1) },
  ]) {
    assert.throws(() => values.encodeValue(bad), values.SerializationError);
  }
  assert.throws(
    () => values.decodeEntry({ family: "pickle", header: {}, frames: [Buffer.alloc(1)] }),
    /language-neutral/,
  );
  assert.throws(
    () =>
      values.decodeEntry({ family: "shoal.array", header: { dtype: "<f8", shape: [3] }, frames: [Buffer.alloc(8)] }),
    /has 24 bytes/,
  );
});

test("the type task-finished reports", () => {
  assert.equal(values.resultType(new Float64Array(1)), "js:Float64Array");
  assert.equal(values.resultType({ dtype: "<i4", shape: [1], data: new Int32Array(1) }), "js:Int32Array");
  assert.equal(values.resultType(1.5), "js:number");
  assert.equal(values.resultType({ a: 1 }), "js:Object");
  assert.equal(values.resultType(new Uint8Array(1)), "js:Uint8Array");
});

test("shoal.call: dependencies (ext 3) and arrays (ext 4) in the arguments", () => {
  const key = new codec.Tuple(["dep", 0]);
  const args = new Encoder({
    extensionCodec: {
      tryToEncode: (o) => (o && o.ext ? new ExtData(o.ext, o.data) : null),
      decode: () => null,
    },
  }).encode([
    [
      { ext: 3, data: codec.packKey(key) },
      { ext: 4, data: new Encoder().encode(["<i4", [2], 1]) },
    ],
    { k: 1 },
  ]);
  const deps = new Map([[codec.keyId(key), "the dependency"]]);
  const [positional, kwargs] = values.decodeCall({}, [args, Buffer.from(new Int32Array([5, 6]).buffer)], deps);
  assert.equal(positional[0], "the dependency");
  assert.deepEqual([...positional[1].data], [5, 6]);
  assert.deepEqual(kwargs, { k: 1 });
  assert.throws(() => values.decodeCall({}, [args], deps), /names frame 1 of 1/);
});
