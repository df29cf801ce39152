// Task functions of the foreign-worker benchmark (bench/workloads/foreign.py): the
// same work as the Python functions next to them there.
"use strict";

function inc(x) {
  return x + 1;
}

// a new array: every element of `a` times `k` (one pass over the bytes, as numpy's a * k)
function scale(a, k) {
  const data = a.data;
  const out = new Float64Array(data.length);
  for (let i = 0; i < data.length; i++) out[i] = data[i] * k;
  return { dtype: "<f8", shape: a.shape, data: out };
}

module.exports = { inc, scale };
