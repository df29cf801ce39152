// An ES module on the search path: found by name like a CommonJS one.
export function join(parts, sep) {
  return parts.join(sep);
}

export async function later(value) {
  await new Promise((resolve) => setTimeout(resolve, 1));
  return { value, kind: typeof value };
}

// keyword arguments, when there are any, come as one object after the positional ones
export function withOptions(first, options) {
  return { first, options: options ?? null };
}
