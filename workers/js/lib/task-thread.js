"use strict";
// A task thread (worker_threads): it decodes a task's payload and inputs, runs the
// function, and encodes the result, so that the main thread only moves bytes and
// keeps serving peers and the scheduler while tasks compute.
//
// Bytes in: the main thread sends each frame copied once into a buffer of its own
// and transfers it (the main thread keeps its values for get-data and other tasks).
// Bytes out: the result's frames are transferred back, not copied; an array a task
// returns is therefore moved to the main thread (its buffer is detached here), unless
// it is a view over part of a larger buffer, which is copied.

const { parentPort, workerData } = require("node:worker_threads");
const fs = require("node:fs");
const path = require("node:path");
const { pathToFileURL } = require("node:url");
const { decodeCall, decodeEntry, encodeValue, resultType, typeName } = require("./values");

const EXTENSIONS = [".js", ".mjs", ".cjs"];
const modules = new Map(); // module name -> Promise of its exports

class ModuleNotFoundError extends Error {
  get name() {
    return "ModuleNotFoundError";
  }
}

class AttributeError extends Error {
  get name() {
    return "AttributeError";
  }
}

function findModule(name, dirs) {
  // a name, not a path: no separators, no leading dot
  if (!/^[A-Za-z0-9_$][A-Za-z0-9_$.-]*$/.test(name) || name.includes("..")) return null;
  for (const dir of dirs) {
    for (const ext of EXTENSIONS) {
      const file = path.resolve(dir, name + ext);
      try {
        if (fs.statSync(file).isFile()) return file;
      } catch {
        // not there: the next candidate
      }
    }
  }
  return null;
}

async function load(file) {
  if (file.endsWith(".mjs")) return import(pathToFileURL(file).href);
  try {
    return require(file);
  } catch (err) {
    if (err && err.code === "ERR_REQUIRE_ESM") return import(pathToFileURL(file).href);
    throw err;
  }
}

function moduleExports(name, dirs) {
  let exports = modules.get(name);
  if (exports === undefined) {
    const file = findModule(name, dirs);
    if (file === null) {
      return Promise.reject(new ModuleNotFoundError(`no module '${name}' on the search path [${dirs.join(", ")}]`));
    }
    exports = load(file);
    exports.catch(() => modules.delete(name)); // a module that failed to load is tried again
    modules.set(name, exports);
  }
  return exports;
}

async function run(task) {
  const dirs = workerData.path;
  const exports = await moduleExports(task.module, dirs);
  const own = (obj) =>
    obj !== null && (typeof obj === "object" || typeof obj === "function") && Object.hasOwn(obj, task.function);
  const fn = own(exports) ? exports[task.function] : own(exports?.default) ? exports.default[task.function] : undefined;
  if (typeof fn !== "function") throw new AttributeError(`module '${task.module}' has no function '${task.function}'`);
  const deps = new Map();
  for (const [id, entry] of task.deps) deps.set(id, decodeEntry(entry));
  const [args, kwargs] = decodeCall(task.header, task.frames, deps);
  // keyword arguments, if any, come as one object after the positional ones
  const value = await (Object.keys(kwargs).length ? fn(...args, kwargs) : fn(...args));
  return { value, ...encodeValue(value) };
}

function transferable(frames) {
  const out = [];
  const transfer = new Set();
  for (const f of frames) {
    const whole =
      f.byteOffset === 0 &&
      f.byteLength === f.buffer.byteLength &&
      f.buffer instanceof ArrayBuffer &&
      !transfer.has(f.buffer);
    const bytes = whole ? new Uint8Array(f.buffer) : Uint8Array.prototype.slice.call(f);
    transfer.add(bytes.buffer);
    out.push(bytes);
  }
  return [out, [...transfer]];
}

parentPort.on("message", async (task) => {
  const start = Date.now() / 1000;
  try {
    const { value, frames, nbytes } = await run(task);
    const stop = Date.now() / 1000;
    const [out, transfer] = transferable(frames);
    parentPort.postMessage(
      { id: task.id, ok: true, frames: out, nbytes, type: resultType(value), start, stop },
      transfer,
    );
  } catch (err) {
    const stop = Date.now() / 1000;
    const error =
      err instanceof Error
        ? { name: err.name, message: err.message, stack: String(err.stack ?? `${err.name}: ${err.message}`) }
        : { name: "Error", message: `a task threw ${typeName(err)}: ${String(err)}`, stack: "" };
    parentPort.postMessage({ id: task.id, ok: false, error, start, stop });
  }
});
