"""The scheduler's IO: turns messages into :mod:`.state` events and instructions into
messages.

Workers and clients each hold one long-lived stream to the scheduler (ops
``register-worker`` and ``register-client``), carrying batches of small messages both
ways; every batch a worker sends counts as a sign of life, and a worker silent for
``worker-ttl`` seconds is removed (:mod:`.liveness`). The scheduler's comms do not
deserialize: task payloads, exceptions and scattered values stay
:class:`~shoal.protocol.Serialized` (or, in-process, the objects themselves) and are
forwarded as they came.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from typing import Any

from .. import config
from ..comm import Comm, security, shm, shm_handover
from ..comm.security import Security, warn_if_exposed
from ..comm.core import local_info
from ..errors import CommError
from ..rpc import BatchedSend, Server, read_batch
from .state import (
    AddClientEvent,
    AddWorkerEvent,
    CancelKeysEvent,
    CheckLivenessEvent,
    ClientMsg,
    CloseWorkerStream,
    ComputeTask,
    FreeKeys,
    HeartbeatEvent,
    Instruction,
    MissingDataEvent,
    NewTask,
    ReleaseKeysEvent,
    RemoveClientEvent,
    RemoveWorkerEvent,
    RescheduleEvent,
    SchedulerState,
    TaskErredEvent,
    TaskFinishedEvent,
    UpdateDataEvent,
    UpdateGraphEvent,
)

__all__ = ["Scheduler"]

logger = logging.getLogger("shoal.scheduler")


class Scheduler:
    """Serves workers and clients; all decisions are :class:`SchedulerState`'s."""

    def __init__(self, name: str = "scheduler", security: Security | None = None):
        self.state = SchedulerState(worker_ttl=config.get("worker-ttl"))
        self.name = name
        #: who may connect: a fresh random secret unless one is given
        self.security = Security.new() if security is None else security
        self.server = Server(
            {
                "identity": self.identity,
                "scheduler-info": self.identity,
                "who-has": self.who_has,
                "update-data": self.update_data,
                "ncores": self.ncores,
                "counters": self.counters,
                "retire-all": self.retire_all,
            },
            stream_handlers={
                "register-worker": self.add_worker,
                "register-client": self.add_client,
            },
            deserialize=False,
            name=name,
            security=self.security,
        )
        self.worker_streams: dict[str, BatchedSend] = {}
        self.worker_comms: dict[str, Comm] = {}
        self.client_streams: dict[str, BatchedSend] = {}
        self._ids = itertools.count()
        self._workers_changed: asyncio.Event | None = None
        self._housekeeping: asyncio.Future[None] | None = None
        self._liveness: asyncio.Future[None] | None = None
        self.closing = False

    @property
    def address(self) -> str:
        return self.server.address

    async def start(self, address: str = "tcp://127.0.0.1:0") -> Scheduler:
        listener = await self.server.listen(address)
        # connections of this process to it find its secret without being told
        security.register(listener.contact_address, self.security)
        warn_if_exposed(listener.listen_address, self.security)
        logger.info("scheduler at %s", self.address)
        if shm.enabled():
            self._housekeeping = asyncio.ensure_future(self._shm_housekeeping(config.get("shm-pool-idle")))
        ttl = self.state.worker_ttl
        if ttl > 0:
            self._liveness = asyncio.ensure_future(self._check_liveness(min(ttl / 4, 1.0)))
        return self

    async def _check_liveness(self, period: float) -> None:
        """Tell the state the time every ``period`` seconds: it removes silent workers."""
        while True:
            await asyncio.sleep(period)
            try:
                self._apply(CheckLivenessEvent(self._stimulus("check-liveness"), time.monotonic()))
            except Exception:
                # a bug, but one that must not end the checks for the rest of the run
                logger.exception("the liveness check failed")

    async def _shm_housekeeping(self, idle: float) -> None:
        """Task arguments sent to same-host workers wait in segments of this process
        while their tasks are known (:mod:`shoal.taskspec`): once a forgotten task's
        payload is garbage its segment goes back to the pool, whose memory is given
        back after ``idle`` seconds unused."""
        while True:
            await asyncio.sleep(1.0)
            shm.work_off()
            if idle > 0:
                shm.trim_pool(idle)

    def _stimulus(self, what: str) -> str:
        return f"{what}-{next(self._ids)}"

    # -- rpc handlers

    def identity(self, comm: Comm | None = None) -> dict[str, Any]:
        return {
            "address": self.address,
            "workers": {
                ws.address: {"nthreads": ws.nthreads, "host": ws.host, "pid": ws.pid, "name": ws.name}
                for ws in self.state.workers.values()
            },
        }

    def ncores(self, comm: Comm | None = None) -> dict[str, int]:
        return {a: ws.nthreads for a, ws in self.state.workers.items()}

    def who_has(self, comm: Comm | None = None, keys: list[Any] | None = None) -> dict[Any, list[str]]:
        tasks = self.state.tasks
        selected = tasks.values() if keys is None else (tasks[k] for k in keys if k in tasks)
        return {ts.key: sorted(ws.address for ws in ts.who_has) for ts in selected}

    def update_data(self, comm: Comm | None = None, who_has: dict[Any, list[str]] | None = None,
                    nbytes: dict[Any, int] | None = None, client: str = "",
                    shm: dict[Any, Any] | None = None) -> None:
        self._apply(UpdateDataEvent(self._stimulus("update-data"), client, who_has or {}, nbytes or {},
                                    shm if isinstance(shm, dict) else {}))

    def counters(self, comm: Comm | None = None) -> dict[str, Any]:
        return {
            "payload_deserializations": self.state.payload_deserializations,
            "tasks": self.state.task_counts(),
        }

    async def retire_all(self, comm: Comm | None = None) -> None:
        """Ask every worker to close (the cluster is shutting down)."""
        for stream in list(self.worker_streams.values()):
            try:
                stream.send({"op": "close"})
            except CommError:
                pass

    # -- streams

    async def add_worker(self, comm: Comm, address: str, nthreads: int, host: str = "",
                         pid: int = 0, name: str = "", **_: Any) -> None:
        if address in self.worker_streams:
            await _reply_error(comm, f"a worker at {address} is already registered")
            return
        if not isinstance(nthreads, int) or nthreads < 1:
            await _reply_error(comm, f"nthreads must be a positive integer, got {nthreads!r}")
            return
        await comm.write({"status": "OK", "address": self.address})
        stream = BatchedSend(name=f"to-{address}")
        stream.start(comm)
        self.worker_streams[address] = stream
        self.worker_comms[address] = comm
        self._apply(AddWorkerEvent(self._stimulus("add-worker"), address, nthreads, host, pid, name,
                                   time.monotonic()))
        logger.info("worker %s joined (%d threads)", address, nthreads)
        self._notify_workers_changed()
        clean = False
        try:
            while True:
                for msg in self._seen(address, await read_batch(comm)):
                    if isinstance(msg, dict) and msg.get("op") == "unregister":
                        clean = True
                    try:
                        self._worker_msg(address, msg)
                    except (KeyError, TypeError, ValueError) as exc:
                        logger.error("worker %s sent a malformed message (%s): %.200r", address, exc, msg)
                if clean:
                    break
        except CommError:
            pass
        finally:
            self.worker_streams.pop(address, None)
            self.worker_comms.pop(address, None)
            stream.abort()
            # a worker removed for its silence was logged then (CloseWorkerStream)
            if not self.closing and address in self.state.workers:
                logger.info("worker %s left%s", address, "" if clean else " (connection lost)")
            self._apply(RemoveWorkerEvent(self._stimulus("remove-worker"), address, crashed=not clean))
            self._notify_workers_changed()
            if not clean and host == local_info()["host"] and pid and shm.process_gone(pid):
                # a worker of this host died: nobody else will remove its segments
                removed = shm.sweep(pid)
                if removed:
                    logger.info("removed %d shared-memory segment(s) of dead worker %s", removed, address)

    def _seen(self, address: str, batch: list[Any]) -> list[Any]:
        """Note that worker ``address`` is alive (whatever it sends shows it, not only
        its heartbeats); returns ``batch``."""
        self._apply(HeartbeatEvent(self._stimulus("seen"), address, time.monotonic()))
        return batch

    def _notify_workers_changed(self) -> None:
        if self._workers_changed is not None:
            self._workers_changed.set()

    async def wait_for_workers(self, n: int, timeout: float | None = None) -> None:
        """Wait until at least ``n`` workers are registered; ``TimeoutError`` after
        ``timeout`` seconds."""

        async def wait() -> None:
            while len(self.state.workers) < n:
                self._workers_changed = asyncio.Event()
                await self._workers_changed.wait()

        try:
            await asyncio.wait_for(wait(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{len(self.state.workers)} of {n} workers arrived within {timeout}s") from None

    def _worker_msg(self, address: str, msg: Any) -> None:
        if not isinstance(msg, dict):
            logger.error("worker %s sent a non-message %r", address, msg)
            return
        op = msg.get("op")
        sid = self._stimulus(str(op))
        if op == "task-finished":
            self._apply(TaskFinishedEvent(sid, address, msg["key"], int(msg.get("nbytes") or 0),
                                          float(msg.get("duration") or 0.0), msg.get("shm"),
                                          msg.get("value")))
        elif op == "task-erred":
            self._apply(TaskErredEvent(sid, address, msg["key"], msg.get("exception"),
                                       msg.get("traceback"), str(msg.get("text", ""))))
        elif op == "missing-data":
            self._apply(MissingDataEvent(sid, msg["key"], msg["errant_worker"]))
        elif op == "reschedule":
            self._apply(RescheduleEvent(sid, address, msg["key"]))
        elif op in ("heartbeat", "unregister"):
            pass
        else:
            logger.error("worker %s sent unknown op %r", address, op)

    async def add_client(self, comm: Comm, client: str, **_: Any) -> None:
        await comm.write({"status": "OK", "address": self.address})
        # a client process of this host gets back the segments it handed its tasks'
        # arguments over in, once the tasks are forgotten (its next ones reuse them)
        peer_pid = comm.peer_info.get("pid")
        pid = peer_pid if isinstance(peer_pid, int) else 0
        same_host = pid > 0 and pid != os.getpid() and comm.peer_info.get("host") == local_info()["host"]
        if same_host:
            shm_handover.return_to.add(pid)
        stream = BatchedSend(name=f"to-{client}")
        stream.start(comm)
        self.client_streams[client] = stream
        self._apply(AddClientEvent(self._stimulus("add-client"), client))
        try:
            while True:
                closing = False
                for msg in await read_batch(comm):
                    if isinstance(msg, dict) and msg.get("op") == "close-client":
                        closing = True
                        continue
                    try:
                        self._client_msg(client, msg)
                    except (KeyError, TypeError, ValueError) as exc:
                        logger.error("client %s sent a malformed message (%s): %.200r", client, exc, msg)
                # hold no message while waiting for the next: its payloads (and their
                # shared memory) must go when their tasks are forgotten
                msg = None
                if same_host:
                    shm.work_off()  # arguments of tasks forgotten just now go back at once
                if closing:
                    break
        except CommError:
            pass
        finally:
            msg = None
            self.client_streams.pop(client, None)
            if same_host:
                shm_handover.return_to.discard(pid)
            self._apply(RemoveClientEvent(self._stimulus("remove-client"), client))
            await stream.close()
            if same_host:
                # what was given back to a departed client process and never taken in
                shm.work_off()
                await shm.sweep_when_gone(pid)

    def _client_msg(self, client: str, msg: Any) -> None:
        if not isinstance(msg, dict):
            logger.error("client %s sent a non-message %r", client, msg)
            return
        op = msg.get("op")
        sid = self._stimulus(str(op))
        if op == "update-graph":
            try:
                for t in msg["tasks"]:
                    hash(t["key"])
                    for d in t.get("deps") or ():
                        hash(d)
                for k in msg.get("wanted") or ():
                    hash(k)
                tasks = [
                    NewTask(t["key"], t.get("payload"), list(t.get("deps") or ()),
                            t.get("workers"), int(t.get("retries") or 0))
                    for t in msg["tasks"]
                ]
            except (KeyError, TypeError, ValueError) as exc:
                logger.error("client %s sent a malformed graph: %r", client, exc)
                wanted = msg.get("wanted")
                for key in wanted if isinstance(wanted, list) else []:
                    try:
                        hash(key)
                    except TypeError:
                        continue
                    self._do(ClientMsg(sid, client, {
                        "op": "task-erred", "key": key, "exception": None, "traceback": None,
                        "text": f"GraphError: the scheduler could not read this graph: {exc!r}",
                        "kind": "GraphError", "blame": key,
                    }))
                return
            self._apply(UpdateGraphEvent(sid, client, tasks, list(msg.get("wanted") or ())))
        elif op == "release-keys":
            self._apply(ReleaseKeysEvent(sid, client, list(msg.get("keys") or ())))
        elif op == "cancel-keys":
            self._apply(CancelKeysEvent(sid, client, list(msg.get("keys") or ())))
        elif op == "heartbeat":
            pass
        else:
            logger.error("client %s sent unknown op %r", client, op)

    # -- instructions

    def _apply(self, event: Any) -> None:
        # free-keys to one worker merge into one message, sent before anything else
        # that goes to that worker, so the worker sees them in the order made
        free: dict[str, list[Any]] = {}
        for inst in self.state.handle(event):
            if isinstance(inst, FreeKeys):
                free.setdefault(inst.worker, []).extend(inst.keys)
                continue
            if isinstance(inst, ComputeTask) and inst.worker in free:
                self._send_worker(inst.worker, {"op": "free-keys", "keys": free.pop(inst.worker)}, lazy=True)
            self._do(inst)
        for worker, keys in free.items():
            # releases need no write of their own: they go with the next task or soon after
            self._send_worker(worker, {"op": "free-keys", "keys": keys}, lazy=True)

    def _do(self, inst: Instruction) -> None:
        if isinstance(inst, ComputeTask):
            msg: dict[str, Any] = {
                "op": "compute-task", "key": inst.key, "payload": inst.payload,
                "who_has": inst.who_has, "nbytes": inst.nbytes, "priority": list(inst.priority),
            }
            if inst.shm:
                msg["shm"] = inst.shm
            if inst.report:
                msg["report"] = True
            self._send_worker(inst.worker, msg)
        elif isinstance(inst, CloseWorkerStream):
            logger.warning("worker %s was silent for %.1f s (worker-ttl is %g s): removed; its tasks go elsewhere",
                           inst.worker, inst.silent_for, self.state.worker_ttl)
            stream = self.worker_streams.get(inst.worker)
            if stream is not None:
                # its handler then sees the connection end, as for a worker that died
                stream.abort()
        elif isinstance(inst, FreeKeys):
            self._send_worker(inst.worker, {"op": "free-keys", "keys": inst.keys}, lazy=True)
        elif isinstance(inst, ClientMsg):
            stream = self.client_streams.get(inst.client)
            if stream is not None:
                try:
                    stream.send(inst.msg)
                except CommError:
                    pass

    def _send_worker(self, address: str, msg: dict[str, Any], lazy: bool = False) -> None:
        stream = self.worker_streams.get(address)
        if stream is None:
            return
        try:
            stream.send(msg, lazy=lazy)
        except CommError:
            pass  # its stream handler will remove the worker

    async def close(self) -> None:
        self.closing = True
        if self._liveness is not None:
            self._liveness.cancel()  # workers that stop talking now are closing
        for listener in self.server.listeners:
            security.unregister(listener.contact_address)
        await self.retire_all()
        for stream in list(self.worker_streams.values()) + list(self.client_streams.values()):
            await stream.close(timeout=2.0)
        await self.server.close()
        if self._housekeeping is not None:
            self._housekeeping.cancel()
        # drop the payloads: arguments of tasks still known that wait in shared memory
        # go back to the pool (their holders are garbage now), and the pool is emptied
        for ts in self.state.tasks.values():
            ts.payload = None
        if shm.enabled():
            shm.work_off()
            shm.drain_pool()


async def _reply_error(comm: Comm, text: str) -> None:
    logger.error(text)
    try:
        await comm.write({"status": "error", "message": text, "type": "ValueError",
                          "traceback": "", "exception": None})
    except CommError:
        pass
    comm.abort()
