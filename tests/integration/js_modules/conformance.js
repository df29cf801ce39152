// The task functions of tests/integration/test_worker_conformance.py, as the Python
// ones there: add, total (an array's sum), scale (a new array, times k), fail.
"use strict";

function add(a, b) {
  return a + b;
}

function total(arr) {
  let sum = 0;
  for (const v of arr.data) sum += v;
  return sum;
}

function scale(arr, k) {
  const out = new Float64Array(arr.data.length);
  for (let i = 0; i < out.length; i++) out[i] = arr.data[i] * k;
  return { dtype: "<f8", shape: arr.shape, data: out };
}

function fail(message) {
  throw new Error(message);
}

module.exports = { add, total, scale, fail };
