"use strict";
// Language-neutral values (docs/protocol.md §4.5): the arguments of a `shoal.call`
// payload, and values in the families `shoal.value`, `shoal.array` and `bytes`.
// Both sides of the mapping are in the README ("How values map").
//
// An n-d array is `{dtype, shape, data}`, `data` a TypedArray of the dtype over the
// received bytes. On the wire it is ext 4 over the msgpack of `[dtype, shape, i]`,
// its bytes frame `i` of the entry (i >= 1).

const { Encoder, ExtData } = require("@msgpack/msgpack");
const { SafeIntDecoder, decodeValue, keyId } = require("./codec");

const EXT_TUPLE = 1;
const EXT_REF = 3;
const EXT_ARRAY = 4;
const MAX_DIMS = 32;

class SerializationError extends Error {
  get name() {
    return "SerializationError";
  }
}

/** dtype -> [TypedArray constructor, item size] */
const DTYPES = {
  "|b1": [Uint8Array, 1],
  "|i1": [Int8Array, 1],
  "|u1": [Uint8Array, 1],
  "<i2": [Int16Array, 2],
  "<u2": [Uint16Array, 2],
  "<i4": [Int32Array, 4],
  "<u4": [Uint32Array, 4],
  "<i8": [BigInt64Array, 8],
  "<u8": [BigUint64Array, 8],
  "<f4": [Float32Array, 4],
  "<f8": [Float64Array, 8],
};

/** The dtype of a bare TypedArray a task returns (Uint8Array is bytes, not here). */
const DTYPE_OF = new Map([
  [Int8Array, "|i1"],
  [Uint8ClampedArray, "|u1"],
  [Int16Array, "<i2"],
  [Uint16Array, "<u2"],
  [Int32Array, "<i4"],
  [Uint32Array, "<u4"],
  [BigInt64Array, "<i8"],
  [BigUint64Array, "<u8"],
  [Float32Array, "<f4"],
  [Float64Array, "<f8"],
]);

/** [TypedArray constructor, item size] of a dtype; SerializationError for another. */
function dtypeSpec(dtype) {
  if (typeof dtype === "string" && Object.hasOwn(DTYPES, dtype)) return DTYPES[dtype];
  throw new SerializationError(`an array of dtype ${JSON.stringify(dtype)} (dtypes: ${Object.keys(DTYPES).join(" ")})`);
}

// -- decoding ----------------------------------------------------------------------

/** The array `[dtype, shape]` describes over `bytes` (a view; see below). */
function arrayOver(dtype, shape, bytes) {
  const spec = dtypeSpec(dtype);
  if (!Array.isArray(shape) || shape.length > MAX_DIMS || !shape.every((n) => Number.isInteger(n) && n >= 0)) {
    throw new SerializationError(`an array's shape is an array of at most ${MAX_DIMS} ints >= 0`);
  }
  const [Ctor, size] = spec;
  const count = shape.reduce((a, b) => a * b, 1);
  if (bytes.byteLength !== count * size) {
    throw new SerializationError(
      `an array of shape [${shape}] and dtype ${dtype} has ${count * size} bytes, got ${bytes.byteLength}`,
    );
  }
  // A view over the received bytes, unless they do not start at a multiple of the item
  // size (a TypedArray cannot be misaligned): then, and only then, a copy.
  const data =
    bytes.byteOffset % size === 0
      ? new Ctor(bytes.buffer, bytes.byteOffset, count)
      : new Ctor(Uint8Array.prototype.slice.call(bytes).buffer, 0, count);
  return { dtype, shape: shape.slice(), data };
}

/**
 * One msgpack value with ext 4 (arrays over `frames`), ext 3 (dependencies, looked
 * up in `deps` by key id, only when `deps` is given) and ext 1 (tuples, read as
 * arrays: neutral values have no tuples).
 */
function decodeNeutral(bytes, frames, deps) {
  const extensions = {
    tryToEncode: () => null,
    decode(data, type, context) {
      if (type === EXT_ARRAY) {
        const parts = plainDecoder().decode(data);
        if (!Array.isArray(parts) || parts.length !== 3)
          throw new SerializationError("an array (ext 4) is [dtype, shape, frame]");
        const [dtype, shape, i] = parts;
        if (!Number.isInteger(i) || i < 1 || i >= frames.length) {
          throw new SerializationError(`an array names frame ${i} of ${frames.length}`);
        }
        return arrayOver(dtype, shape, frames[i]);
      }
      if (type === EXT_REF && deps) {
        const key = decodeValue(data);
        const id = keyId(key);
        if (!deps.has(id))
          throw new SerializationError(`a dependency the task was not given: ${JSON.stringify(String(id))}`);
        return deps.get(id);
      }
      if (type === EXT_TUPLE) {
        const depth = context.depth + 1;
        if (depth > 32) throw new SerializationError("tuples nested more than 32 deep");
        return decoderWith({ depth }).decode(data);
      }
      throw new SerializationError(`unknown msgpack extension type ${type} in a value`);
    },
  };
  const decoderWith = (context) =>
    new SafeIntDecoder({ extensionCodec: extensions, context, useBigInt64: true, mapKeyConverter: strKey });
  return decoderWith({ depth: 0 }).decode(bytes);
}

function strKey(key) {
  if (typeof key === "string") return key;
  throw new SerializationError(`a map key of a value is a str, got a ${typeof key}`);
}

function plainDecoder() {
  return new SafeIntDecoder({ useBigInt64: true, mapKeyConverter: strKey });
}

/** `[args, kwargs]` of a `shoal.call` payload; `deps`: key id -> value. */
function decodeCall(header, frames, deps) {
  if (!frames.length) throw new SerializationError("a shoal.call has at least one frame");
  const call = decodeNeutral(frames[0], frames, deps);
  if (
    !Array.isArray(call) ||
    call.length !== 2 ||
    !Array.isArray(call[0]) ||
    call[1] === null ||
    typeof call[1] !== "object" ||
    Array.isArray(call[1])
  ) {
    throw new SerializationError("a shoal.call's first frame is [args, kwargs]");
  }
  return call;
}

/**
 * The value of an out-of-band entry a peer sent (`{family, header, frames}`) or of an
 * inline value (`{family: "inline", value}`); `SerializationError` for a value no
 * JavaScript worker can read (a pickle, an unknown family).
 */
function decodeEntry(entry) {
  const { family, header, frames } = entry;
  switch (family) {
    case "inline":
      return entry.value;
    case "shoal.value":
      if (!frames.length) throw new SerializationError("a shoal.value has at least one frame");
      return decodeNeutral(frames[0], frames, null);
    case "shoal.array":
      if (frames.length !== 1) throw new SerializationError(`a shoal.array has one frame, got ${frames.length}`);
      return arrayOver(header.dtype, header.shape, frames[0]);
    case "bytes":
      if (header.kind === "pickle") throw new SerializationError("a subclass of bytes, pickled: a Python object");
      if (frames.length !== 1) throw new SerializationError(`a bytes value has one frame, got ${frames.length}`);
      return frames[0];
    case "pickle":
      throw new SerializationError(
        "the value is a Python object (family 'pickle'): a js worker reads only language-neutral values",
      );
    default:
      throw new SerializationError(`a value of family ${JSON.stringify(family)}, which a js worker does not read`);
  }
}

// -- encoding ----------------------------------------------------------------------

/**
 * The frames of `value` as one `shoal.value` entry: `[msgpack, buffer_1, ...]`.
 * Returns `{frames, nbytes}`; `SerializationError` for a value that is not neutral.
 */
function encodeValue(value) {
  const buffers = [];
  const extensions = {
    tryToEncode(object) {
      const array = asArray(object);
      if (array === null) {
        if (object instanceof Uint8Array || Array.isArray(object)) return null;
        if (
          ArrayBuffer.isView(object) ||
          object instanceof ArrayBuffer ||
          object instanceof Map ||
          object instanceof Set ||
          object instanceof Date ||
          typeof object === "function" ||
          typeof object === "symbol" ||
          (Object.getPrototypeOf(object) !== Object.prototype && Object.getPrototypeOf(object) !== null)
        ) {
          throw new SerializationError(
            `a value of type ${typeName(object)} has no meaning in another language ` +
              "(values: null, booleans, numbers, BigInt, strings, Uint8Array, arrays, plain objects, TypedArrays, {dtype, shape, data})",
          );
        }
        return null;
      }
      const bytes = new Uint8Array(array.data.buffer, array.data.byteOffset, array.data.byteLength);
      buffers.push(bytes);
      return new ExtData(EXT_ARRAY, new Encoder().encode([array.dtype, array.shape, buffers.length]));
    },
    decode() {
      throw new Error("not a decoder");
    },
  };
  let packed;
  try {
    packed = new Encoder({
      extensionCodec: extensions,
      useBigInt64: true,
      maxDepth: 100,
      ignoreUndefined: false,
    }).encode(checkScalars(value, 0));
  } catch (err) {
    if (err instanceof SerializationError) throw err;
    throw new SerializationError(err.message);
  }
  const frames = [packed, ...buffers];
  return { frames, nbytes: frames.reduce((n, f) => n + f.byteLength, 0) };
}

/** Scalars msgpack would encode wrongly or not at all. */
function checkScalars(value, depth) {
  if (depth > 100) throw new SerializationError("a value nests deeper than 100");
  if (value === undefined) return null;
  if (typeof value === "function" || typeof value === "symbol") {
    throw new SerializationError(`a value of type ${typeof value} has no meaning in another language`);
  }
  if (typeof value === "bigint" && (value < -(1n << 63n) || value >= 1n << 64n)) {
    throw new SerializationError("a BigInt outside [-2^63, 2^64) has no meaning in another language");
  }
  if (Array.isArray(value)) {
    for (const v of value) checkScalars(v, depth + 1);
  } else if (
    value !== null &&
    typeof value === "object" &&
    !ArrayBuffer.isView(value) &&
    Object.getPrototypeOf(value) === Object.prototype &&
    asArray(value) === null
  ) {
    for (const v of Object.values(value)) checkScalars(v, depth + 1);
  }
  return value;
}

/** `{dtype, shape, data}` for a value that is an array, else null. */
function asArray(object) {
  if (object === null || typeof object !== "object") return null;
  if (ArrayBuffer.isView(object) && !(object instanceof DataView)) {
    const dtype = DTYPE_OF.get(object.constructor);
    return dtype === undefined ? null : { dtype, shape: [object.length], data: object };
  }
  if (Object.getPrototypeOf(object) !== Object.prototype) return null;
  const { dtype, shape, data } = object;
  if (typeof dtype !== "string" || !ArrayBuffer.isView(data) || data instanceof DataView) return null;
  const spec = dtypeSpec(dtype);
  if (!(data instanceof spec[0]))
    throw new SerializationError(
      `an array of dtype ${dtype} has data of ${spec[0].name}, got ${data.constructor.name}`,
    );
  if (!Array.isArray(shape) || shape.length > MAX_DIMS || !shape.every((n) => Number.isInteger(n) && n >= 0)) {
    throw new SerializationError(`an array's shape is an array of at most ${MAX_DIMS} ints >= 0`);
  }
  const count = shape.reduce((a, b) => a * b, 1);
  if (count !== data.length)
    throw new SerializationError(`an array of shape [${shape}] has ${count} items, its data ${data.length}`);
  return { dtype, shape, data };
}

/** The type of a value as JavaScript names it: "Float64Array", "number", "Map", ... */
function typeName(value) {
  if (value === null) return "null";
  if (typeof value !== "object") return typeof value;
  const proto = Object.getPrototypeOf(value);
  return proto === null ? "Object" : (proto.constructor?.name ?? "Object");
}

/** What `task-finished`'s `type` says of a result: "js:Float64Array" for an array (bare
 * or as {dtype, shape, data}), else "js:" and its type ("js:number", "js:Object"). */
function resultType(value) {
  let array = null;
  try {
    array = asArray(value);
  } catch {
    // not an array after all: its own type
  }
  return `js:${array ? array.data.constructor.name : typeName(value)}`;
}

module.exports = {
  DTYPES,
  SerializationError,
  arrayOver,
  decodeCall,
  decodeEntry,
  encodeValue,
  resultType,
  typeName,
};
