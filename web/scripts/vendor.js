// Copies the built chart library and its licence files into the Python package, so
// that installing shoal needs no npm: run `npm ci && npm run vendor` after changing
// the pinned version in package.json, and commit what changed under static/vendor/.
"use strict";

const fs = require("fs");
const path = require("path");

const modules = path.join(__dirname, "..", "node_modules");
const vendor = path.join(__dirname, "..", "..", "shoal", "dashboard", "static", "vendor");

// [from, under node_modules] -> [to, under static/vendor]
const files = [
  ["echarts/dist/echarts.min.js", "echarts.min.js"],
  ["echarts/LICENSE", "LICENSE"],
  ["echarts/NOTICE", "NOTICE"],
  ["echarts/licenses/LICENSE-d3", "LICENSE-d3"],
  // built into echarts.min.js: its renderer and helpers
  ["zrender/LICENSE", "LICENSE-zrender"],
  ["tslib/LICENSE.txt", "LICENSE-tslib"],
];

fs.mkdirSync(vendor, { recursive: true });
for (const [from, to] of files) {
  fs.copyFileSync(path.join(modules, from), path.join(vendor, to));
}
const version = require(path.join(modules, "echarts", "package.json")).version;
fs.writeFileSync(path.join(vendor, "VERSION"), `echarts ${version}\n`);
console.log(`copied echarts ${version} and its licences into ${path.relative(process.cwd(), vendor)}`);
