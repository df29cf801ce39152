#!/usr/bin/env node
"use strict";
// shoal-worker: a shoal worker that runs JavaScript task functions.
//
//   node bin/shoal-worker.js tcp://HOST:PORT --nthreads N --path DIR [--path DIR2]
//        [--name NAME] [--listen-host HOST] [--auth-file FILE] [--no-auth]
//
// Prints "shoal js worker at tcp://HOST:PORT" on stdout once registered.

const path = require("node:path");
const { JsWorker } = require("../lib/worker");

const USAGE =
  "usage: shoal-worker.js tcp://HOST:PORT [--nthreads N] --path DIR [--path DIR ...] " +
  "[--name NAME] [--listen-host HOST] [--auth-file FILE] [--no-auth]";

function parseArgs(argv) {
  const options = { nthreads: 1, path: [], noAuth: false };
  const value = (i, flag) => {
    if (i >= argv.length) throw new Error(`${flag} needs a value`);
    return argv[i];
  };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    switch (arg) {
      case "--nthreads": {
        const n = Number(value(++i, arg));
        if (!Number.isInteger(n) || n < 1) throw new Error("--nthreads is an int >= 1");
        options.nthreads = n;
        break;
      }
      case "--path":
        options.path.push(path.resolve(value(++i, arg)));
        break;
      case "--name":
        options.name = value(++i, arg);
        break;
      case "--listen-host":
        options.listenHost = value(++i, arg);
        break;
      case "--auth-file":
        options.authFile = value(++i, arg);
        break;
      case "--no-auth":
        options.noAuth = true;
        break;
      case "-h":
      case "--help":
        process.stdout.write(USAGE + "\n");
        process.exit(0);
        break;
      default:
        if (arg.startsWith("-") || options.scheduler) throw new Error(`unexpected argument ${JSON.stringify(arg)}`);
        options.scheduler = arg;
    }
  }
  if (!options.scheduler) throw new Error("the scheduler's address is missing");
  if (!options.path.length) options.path.push(process.cwd());
  return options;
}

async function main() {
  let options;
  try {
    options = parseArgs(process.argv.slice(2));
  } catch (err) {
    process.stderr.write(`shoal-worker: ${err.message}\n${USAGE}\n`);
    process.exit(2);
  }
  const worker = new JsWorker(options);
  // a failure on one connection must not end the worker: it is logged
  process.on("unhandledRejection", (err) => process.stderr.write(`shoal-worker: ${err?.stack ?? err}\n`));
  for (const signal of ["SIGTERM", "SIGINT"]) {
    process.on(signal, () => {
      worker.leave().catch(() => process.exit(1));
    });
  }
  try {
    const address = await worker.start();
    process.stdout.write(`shoal js worker at ${address}\n`);
  } catch (err) {
    process.stderr.write(`shoal-worker: ${err.message}\n`);
    process.exit(1);
  }
}

main();
