// Task functions of tests/integration/test_js_worker.py (CommonJS).
"use strict";

// a new array: every element of `x` (any dtype) times `k`, as float64, same shape
function scale(x, k) {
  const out = new Float64Array(x.data.length);
  for (let i = 0; i < out.length; i++) out[i] = Number(x.data[i]) * k;
  return { dtype: "<f8", shape: x.shape, data: out };
}

// the sum of an array's elements (a number)
function total(x) {
  let sum = 0;
  for (const v of x.data) sum += Number(v);
  return sum;
}

// an n-d int32 array: element [i][j] is i * cols + j
function grid(rows, cols) {
  const data = new Int32Array(rows * cols);
  for (let i = 0; i < data.length; i++) data[i] = i;
  return { dtype: "<i4", shape: [rows, cols], data };
}

// a bare TypedArray: a 1-D array
function ramp(n) {
  return Float32Array.from({ length: n }, (_, i) => i / 2);
}

// whatever it is given, described: the JS types a Python value arrives as
function describe(value) {
  if (value === null) return "null";
  if (ArrayBuffer.isView(value)) return value.constructor.name;
  if (Array.isArray(value)) return `array(${value.length})`;
  return typeof value;
}

// a Map: no neutral value (the task errs with SerializationError)
function mapped() {
  return new Map([["a", 1]]);
}

function fail(message) {
  throw new RangeError(message);
}

// busy for `ms` milliseconds (a CPU-bound task: it holds its thread), then `value`
function slow(ms, value) {
  const end = Date.now() + ms;
  while (Date.now() < end) {
    // spin
  }
  return value;
}

module.exports = { scale, total, grid, ramp, describe, mapped, fail, slow };
