"use strict";
// A pool of task threads (worker_threads), one task at a time on each.

const path = require("node:path");
const { Worker } = require("node:worker_threads");

const THREAD_SCRIPT = path.join(__dirname, "task-thread.js");

class ThreadPool {
  /** `n` threads that find task modules on `searchPath` (directories). */
  constructor(n, searchPath, onLog) {
    this.searchPath = searchPath;
    this.onLog = onLog;
    this.threads = [];
    this.closed = false;
    for (let i = 1; i <= n; i++) this.threads.push(this.spawn(i));
  }

  spawn(number) {
    const thread = { number, worker: null, current: null };
    const worker = new Worker(THREAD_SCRIPT, { workerData: { path: this.searchPath } });
    worker.on("message", (result) => {
      const current = thread.current;
      thread.current = null;
      if (current) current.resolve(result);
    });
    const died = (err) => {
      if (this.closed || thread.worker !== worker) return;
      thread.worker = null;
      const current = thread.current;
      thread.current = null;
      this.onLog(`task thread ${number} ended: ${err.message}; starting another`);
      if (current) current.reject(err);
      this.threads[number - 1] = this.spawn(number);
      this.onIdle?.();
    };
    worker.on("error", died);
    worker.on("exit", (code) => died(new Error(`the task thread exited with code ${code}`)));
    thread.worker = worker;
    return thread;
  }

  /** A thread with nothing to do, or null. */
  idle() {
    return this.threads.find((t) => t.worker !== null && t.current === null) ?? null;
  }

  /**
   * Runs `task` (a message for task-thread.js) on `thread`; resolves with the
   * thread's answer, rejects if the thread dies meanwhile. `transfer`: the
   * ArrayBuffers moved to the thread with the message.
   */
  run(thread, task, transfer) {
    return new Promise((resolve, reject) => {
      thread.current = { resolve, reject };
      thread.worker.postMessage(task, transfer);
    });
  }

  async close() {
    this.closed = true;
    await Promise.all(this.threads.map((t) => t.worker?.terminate()));
  }
}

module.exports = { ThreadPool };
