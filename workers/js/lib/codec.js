"use strict";
// msgpack as shoal's messages use it (docs/protocol.md §4.1): tuples are ext 1,
// out-of-band references ext 2; no other ext type in a header. Map keys that are not
// plain strings (task keys such as tuples or ints) become "key ids" (keyId below), so
// that decoded maps stay plain objects and a key found in a field and the same key
// found as a map key compare equal.

const { Decoder, Encoder, ExtData } = require("@msgpack/msgpack");

const EXT_TUPLE = 1;
const EXT_OOB = 2;
const MAX_TUPLE_DEPTH = 32; // §4.1

class ProtocolError extends Error {
  get name() {
    return "ProtocolError";
  }
}

/** A Python tuple: ext 1 over the msgpack of its items (§4.1). */
class Tuple {
  constructor(items) {
    this.items = items;
  }
}

/** An out-of-band value: one entry of a message's table (§4.2). */
class OOB {
  constructor(family, header, frames, opaque = true) {
    this.family = family;
    this.header = header;
    this.frames = frames;
    this.opaque = opaque;
  }
}

/** A decoder whose 64-bit ints are numbers when they are safe, BigInt otherwise. */
class SafeIntDecoder extends Decoder {
  readU64AsBigInt() {
    const value = super.readU64AsBigInt();
    return value <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(value) : value;
  }

  readI64AsBigInt() {
    const value = super.readI64AsBigInt();
    return value <= BigInt(Number.MAX_SAFE_INTEGER) && value >= BigInt(Number.MIN_SAFE_INTEGER) ? Number(value) : value;
  }

  clone() {
    throw new Error("nested decoding uses its own decoder");
  }
}

// -- keys ------------------------------------------------------------------------

const keyEncoder = () => new Encoder({ extensionCodec: headerExtensions, useBigInt64: true });

/** The msgpack of a task key as shoal's messages carry it (tuples as ext 1). */
function packKey(key) {
  return keyEncoder().encode(key);
}

/**
 * A string that names a task key: the key itself for a str (that does not start with
 * NUL), else NUL and the base64 of its msgpack. Equal keys give equal ids.
 */
function keyId(key) {
  if (typeof key === "string" && !key.startsWith("\0")) return key;
  if (!isKey(key, 0)) throw new ProtocolError(`not a task key: ${describe(key)}`);
  return "\0" + Buffer.from(packKey(key)).toString("base64");
}

/** The key a key id names. */
function keyFromId(id) {
  if (!id.startsWith("\0")) return id;
  return decodeValue(Buffer.from(id.slice(1), "base64"));
}

/** The msgpack bytes of the key a key id names. */
function packedKeyOfId(id) {
  return id.startsWith("\0") ? Buffer.from(id.slice(1), "base64") : packKey(id);
}

function isKey(key, depth) {
  switch (typeof key) {
    case "string":
    case "number":
    case "bigint":
      return true;
    case "object":
      if (key instanceof Uint8Array) return true;
      if (key instanceof Tuple) return depth < 16 && key.items.every((k) => isKey(k, depth + 1));
      return false;
    default:
      return false;
  }
}

function describe(value) {
  if (value === null) return "nil";
  if (Array.isArray(value)) return "an array";
  if (value instanceof OOB) return "an out-of-band value";
  return typeof value === "object" ? `a ${value.constructor?.name ?? "map"}` : `a ${typeof value}`;
}

// -- the extensions of a header --------------------------------------------------

const headerExtensions = {
  tryToEncode(object, context) {
    if (object instanceof Tuple) {
      return new ExtData(EXT_TUPLE, keyEncoderWith(context).encode(object.items));
    }
    if (object instanceof OOB) {
      if (!context || !context.entries) throw new Error("an out-of-band value where none may be");
      const data = Buffer.alloc(4);
      data.writeUInt32LE(context.entries.length);
      context.entries.push(object);
      return new ExtData(EXT_OOB, data);
    }
    if (object instanceof ExtData) return object;
    return null;
  },
  decode(data, type, context) {
    if (type === EXT_TUPLE) {
      const depth = (context.depth ?? 0) + 1;
      if (depth > MAX_TUPLE_DEPTH) throw new ProtocolError(`tuples nested more than ${MAX_TUPLE_DEPTH} deep`);
      const items = newDecoder({ ...context, depth }).decode(data);
      if (!Array.isArray(items)) throw new ProtocolError("a tuple (ext 1) whose data is not an array");
      return new Tuple(items);
    }
    if (type === EXT_OOB && context.entries) {
      if (data.length < 1 || data.length > 6) throw new ProtocolError("an out-of-band reference of bad length");
      const index = Buffer.from(data.buffer, data.byteOffset, data.byteLength).readUIntLE(0, data.length);
      const entry = context.entries[index];
      if (entry === undefined) throw new ProtocolError(`out-of-band value ${index} is not in the table`);
      entry.used = true;
      return entry;
    }
    throw new ProtocolError(`unknown msgpack extension type ${type}`);
  },
};

function keyEncoderWith(context) {
  return new Encoder({ extensionCodec: headerExtensions, context, useBigInt64: true });
}

function mapKey(key) {
  return keyId(key);
}

function newDecoder(context) {
  return new SafeIntDecoder({
    extensionCodec: headerExtensions,
    context,
    useBigInt64: true,
    mapKeyConverter: mapKey,
  });
}

/** One msgpack value (exactly: trailing bytes are an error), with ext 1 only. */
function decodeValue(bytes) {
  return newDecoder({ depth: 0 }).decode(bytes);
}

// -- messages (§4) ---------------------------------------------------------------

/**
 * The frames of a message: the header, and when it has out-of-band values (OOB
 * objects anywhere in it) the table and their frames. `rawHeader`, when given, is
 * the header already packed (with `entries` the OOB values it references).
 */
function encodeMessage(value, rawHeader = null, entries = null) {
  const context = { entries: entries ?? [] };
  const header =
    rawHeader ?? new Encoder({ extensionCodec: headerExtensions, context, useBigInt64: true }).encode(value);
  if (context.entries.length === 0) return [header];
  const table = context.entries.map((e) => [e.family, e.header ?? {}, e.frames.length, e.opaque !== false]);
  const tableBytes = new Encoder({ extensionCodec: headerExtensions, useBigInt64: true }).encode(table);
  const frames = [header, tableBytes];
  for (const e of context.entries) frames.push(...e.frames);
  return frames;
}

/** A message's value, its out-of-band values as OOB objects (never decoded here). */
function decodeMessage(frames) {
  if (frames.length === 0 || frames[0].length === 0) throw new ProtocolError("malformed message header: empty");
  let entries = null;
  if (frames.length > 1) entries = decodeTable(frames);
  let value;
  try {
    value = newDecoder({ entries, depth: 0 }).decode(frames[0]);
  } catch (err) {
    if (err instanceof ProtocolError) throw err;
    throw new ProtocolError(`malformed message header: ${err.message}`);
  }
  return value;
}

function decodeTable(frames) {
  let table;
  try {
    table = new SafeIntDecoder({
      extensionCodec: { tryToEncode: () => null, decode: tableExt },
      context: { depth: 0 },
      useBigInt64: true,
    }).decode(frames[1]);
  } catch (err) {
    throw new ProtocolError(`malformed out-of-band table: ${err.message}`);
  }
  if (!Array.isArray(table)) throw new ProtocolError("malformed out-of-band table: not an array");
  const entries = [];
  let next = 2;
  for (const entry of table) {
    if (!Array.isArray(entry) || (entry.length !== 4 && entry.length !== 5)) {
      throw new ProtocolError("malformed out-of-band table: an entry is not an array of 4 or 5");
    }
    const [family, header, nFrames, opaque] = entry;
    if (typeof family !== "string") throw new ProtocolError("malformed out-of-band table: a family is not a str");
    if (!Number.isInteger(nFrames) || nFrames < 0) {
      throw new ProtocolError("malformed out-of-band table: n_frames is not an int >= 0");
    }
    if (
      entry.length === 5 &&
      !(Array.isArray(entry[4]) && entry[4].every((i) => Number.isInteger(i) || typeof i === "bigint"))
    ) {
      throw new ProtocolError("malformed out-of-band table: lease ids are not an array of ints");
    }
    if (next + nFrames > frames.length) throw new ProtocolError("the table names more frames than were sent");
    const h =
      header !== null && typeof header === "object" && !Array.isArray(header) && !(header instanceof Uint8Array)
        ? header
        : {};
    entries.push(new OOB(family, h, frames.slice(next, next + nFrames), Boolean(opaque)));
    next += nFrames;
  }
  if (next !== frames.length)
    throw new ProtocolError(`the table names ${next - 2} frames, ${frames.length - 2} were sent`);
  return entries;
}

function tableExt(data, type, context) {
  if (type === EXT_TUPLE) return headerExtensions.decode(data, type, context);
  throw new ProtocolError(`msgpack extension type ${type} in the table`);
}

/** A stranger's message (§3): one frame of plain msgpack, a map, str keys, <= 4 deep. */
function decodeStranger(frames) {
  if (frames.length !== 1) throw new ProtocolError("a handshake message has one frame");
  const value = new SafeIntDecoder({
    extensionCodec: {
      tryToEncode: () => null,
      decode: () => {
        throw new ProtocolError("an extension type in a handshake message");
      },
    },
    useBigInt64: true,
  }).decode(frames[0]);
  if (value === null || typeof value !== "object" || Array.isArray(value) || value instanceof Uint8Array) {
    throw new ProtocolError("a handshake message is a map");
  }
  if (depthOf(value, 0) > 4) throw new ProtocolError("a handshake message nests more than 4 levels");
  return value;
}

function depthOf(value, depth) {
  if (value === null || typeof value !== "object" || value instanceof Uint8Array) return depth;
  let most = depth + 1;
  for (const v of Array.isArray(value) ? value : Object.values(value)) {
    most = Math.max(most, depthOf(v, depth + 1));
    if (most > 8) break;
  }
  return most;
}

// -- packing by hand: maps whose keys are task keys ----------------------------

function mapHeader(n) {
  if (n < 16) return Buffer.from([0x80 + n]);
  if (n < 0x10000) {
    const b = Buffer.alloc(3);
    b[0] = 0xde;
    b.writeUInt16BE(n, 1);
    return b;
  }
  const b = Buffer.alloc(5);
  b[0] = 0xdf;
  b.writeUInt32BE(n, 1);
  return b;
}

/**
 * The packed header of a successful get-data response (§8.1): `{"status": "OK",
 * "result": {"data": {key: value}}}` for [keyId, OOB] pairs; msgpack maps of plain
 * objects can only have str keys, so this map is put together by hand.
 */
function getDataResponse(pairs) {
  const entries = [];
  const enc = (v) =>
    new Encoder({ extensionCodec: headerExtensions, context: { entries }, useBigInt64: true }).encode(v);
  const parts = [
    mapHeader(2),
    enc("status"),
    enc("OK"),
    enc("result"),
    mapHeader(1),
    enc("data"),
    mapHeader(pairs.length),
  ];
  for (const [id, value] of pairs) {
    parts.push(packedKeyOfId(id), enc(value));
  }
  return encodeMessage(null, Buffer.concat(parts), entries);
}

/** `value` with tuples as arrays (what a task sees of a tuple). */
function untuple(value) {
  if (value instanceof Tuple) return value.items.map(untuple);
  if (Array.isArray(value)) return value.map(untuple);
  if (value !== null && typeof value === "object" && !ArrayBuffer.isView(value) && !(value instanceof OOB)) {
    const out = {};
    for (const [k, v] of Object.entries(value))
      out[k.startsWith("\0") ? String(untuple(keyFromId(k))) : k] = untuple(v);
    return out;
  }
  return value;
}

module.exports = {
  OOB,
  ProtocolError,
  SafeIntDecoder,
  Tuple,
  decodeMessage,
  decodeStranger,
  decodeValue,
  encodeMessage,
  getDataResponse,
  isKey,
  keyFromId,
  keyId,
  packKey,
  untuple,
};
