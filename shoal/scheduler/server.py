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
import math
import os
import sys
import time
from collections.abc import Iterable
from functools import partial
from typing import Any

from .. import config, gcpolicy
from ..comm import Comm, security, shm, shm_handover
from ..comm.security import Security, warn_if_exposed
from ..comm.core import local_info
from ..errors import CommError, ProtocolError, SerializationError, describe, short_repr
from ..statelog import internal_error, keys_of
from ..protocol import REMOTE, Serialized
from ..protocol.serialize import forwarded
from ..protocol.messages import (
    CLIENT_TO_SCHEDULER,
    COORDINATION_STREAM,
    SCHEDULER_REQUESTS,
    WORKER_TO_SCHEDULER,
    CancelKeysMsg,
    CloseClientMsg,
    CloseMsg,
    ComputeTaskMsg,
    FireAndForgetMsg,
    FreeKeysMsg,
    HeartbeatMsg,
    LongRunningMsg,
    WorkerMemoryMsg,
    MissingDataMsg,
    AddReplicaMsg,
    Msg,
    ReleaseKeysMsg,
    RescheduleMsg,
    TaskErredMsg,
    TaskFinishedMsg,
    UnregisterMsg,
    UpdateGraphMsg,
    WorkerTaskErredMsg,
    decode,
    for_destination,
    key_problem,
    to_wire,
)
from ..rpc import BatchedSend, Server, read_batch, without_values
from .plugin import SchedulerPlugin, call_async, tell_plugins
from .progress import ProgressRequests
from .diagnostics import Diagnostics
from .coordination_server import CoordinationServer
from .worker_plugins import WorkerPluginStore
from .ops import SchedulerOps
from .holder_checks import HolderChecks
from .state import (
    AddClientEvent,
    AddWorkerEvent,
    CancelKeysEvent,
    CheckHolder,
    CheckLivenessEvent,
    ClientMsg,
    CloseWorkerStream,
    ComputeTask,
    FailKeysEvent,
    FireAndForgetEvent,
    FreeKeys,
    HeartbeatEvent,
    Instruction,
    LongRunningEvent,
    WorkerMemoryEvent,
    MissingDataEvent,
    ReplicaAddedEvent,
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
    Warn,
)

__all__ = ["Scheduler"]


def _memory_figures(memory: dict[str, int]) -> dict[str, int]:
    """A worker's memory as ``scheduler_info()`` shows it: every figure, 0 until it said."""
    return {name: memory.get(name, 0) for name in ("limit", "managed", "shm", "spilled", "unmanaged", "process")}

logger = logging.getLogger("shoal.scheduler")

#: a worker's messages note it alive at most this often (seconds), and at most a
#: twentieth of ``worker-ttl``
_SEEN_EVERY = 0.5
#: after a graph of this many tasks (a part of a big one) the loop turns before the next
_YIELD_AFTER_TASKS = 1_000


class Scheduler:
    """Serves workers and clients; all decisions are :class:`SchedulerState`'s."""

    def __init__(self, name: str = "scheduler", security: Security | None = None,
                 plugins: Iterable[SchedulerPlugin] = (), dashboard_address: str | None = None):
        self.state = SchedulerState(worker_ttl=config.get("worker-ttl"))
        #: the task stream and the figures the dashboard shows (:mod:`.diagnostics`)
        self.diagnostics = Diagnostics(self.state, lambda: self.address, time.time,
                                       config.get("dashboard-task-stream-size"))
        #: where to serve the dashboard (":8790": port 8790 of the host it listens on;
        #: None: no dashboard); the running one (:mod:`shoal.dashboard`) or None
        self.dashboard_address = dashboard_address
        self.dashboard: Any = None
        #: objects of this process told what the scheduler does (:mod:`.plugin`)
        self.plugins: dict[str, SchedulerPlugin] = {}
        self._initial_plugins = list(plugins)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.name = name
        #: who may connect: a fresh random secret unless one is given
        self.security = Security.new() if security is None else security
        #: named variables, queues, locks, events, pub/sub and datasets (shoal.Variable, ...)
        self.coordination = CoordinationServer(self)
        #: worker plugins (opaque) for the workers that join later
        self.worker_plugins = WorkerPluginStore(lambda: self.worker_streams)
        #: the client's cluster operations (has-what, rebalance, restart, upload-file, ...)
        self.ops = SchedulerOps(self)
        #: the questions out to holders that peers say did not serve them
        self.holder_checks = HolderChecks(self)
        self.server = Server(
            {
                "identity": self.identity,
                "scheduler-info": self.identity,
                "who-has": self.who_has,
                "update-data": self.update_data,
                "ncores": self.ncores,
                "counters": self.counters,
                "retire-all": self.retire_all,
                "progress": ProgressRequests(lambda: self.state.tasks, time.monotonic).handle,
                "get-task-stream": self.get_task_stream,
                "diagnostics": self.diagnostics_now,
                **self.coordination.handlers(),
                **self.worker_plugins.handlers(),
                **self.ops.handlers(),
            },
            stream_handlers={
                "register-worker": self.add_worker,
                "register-client": self.add_client,
            },
            deserialize=False,
            name=name,
            security=self.security,
            schemas=SCHEDULER_REQUESTS,
            role="scheduler",
        )
        self.worker_streams: dict[str, BatchedSend] = {}
        self.worker_comms: dict[str, Comm] = {}
        self.client_streams: dict[str, BatchedSend] = {}
        self._ids = itertools.count()
        #: when each worker was last noted alive (see _seen)
        self._seen_at: dict[str, float] = {}
        ttl = self.state.worker_ttl
        self._seen_every = min(_SEEN_EVERY, ttl / 20) if ttl > 0 else _SEEN_EVERY
        self._workers_changed: asyncio.Event | None = None
        self._housekeeping: asyncio.Future[None] | None = None
        self._liveness: asyncio.Future[None] | None = None
        self.closing = False
        #: whether it holds the collector's policy of this process (shoal.gcpolicy)
        self._gc_held = False

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def dashboard_link(self) -> str | None:
        """The dashboard's status page (``http://host:port/status``), or None. Without
        its token (this goes to every client: each adds the token of its own secret,
        ``Client.dashboard_link``); ``dashboard.login_link`` has it."""
        return self.dashboard.link if self.dashboard is not None else None

    async def start(self, address: str = "tcp://127.0.0.1:0") -> Scheduler:
        #: the loop it runs on (plugins of this process are added there)
        self.loop = asyncio.get_running_loop()
        listener = await self.server.listen(address)
        if not self._gc_held:
            self._gc_held = True
            gcpolicy.hold()
        # connections of this process to it find its secret without being told
        security.register(listener.contact_address, self.security)
        warn_if_exposed(listener.listen_address, self.security)
        logger.info("scheduler at %s", self.address)
        if shm.enabled():
            self._housekeeping = asyncio.ensure_future(self._shm_housekeeping(config.get("shm-pool-idle")))
        ttl = self.state.worker_ttl
        if ttl > 0:
            self._liveness = asyncio.ensure_future(self._check_liveness(min(ttl / 4, 1.0)))
        for plugin in self._initial_plugins:
            await self.add_plugin(plugin)
        if self.dashboard_address is not None and self.dashboard is None:
            from ..dashboard import start_if_available  # (a layer above: only when asked)

            self.dashboard = await start_if_available(self, self.dashboard_address)
        return self

    async def add_plugin(self, plugin: SchedulerPlugin, name: str | None = None) -> None:
        """Add ``plugin`` (an object of this process; one of the same name is replaced,
        after its ``close()``) and call its ``start(scheduler)``."""
        name = name or getattr(plugin, "name", None) or f"{type(plugin).__name__}-{id(plugin):x}"
        old = self.plugins.pop(name, None)
        if old is not None:
            await call_async(old, "close")
        self.plugins[name] = plugin
        await call_async(plugin, "start", self)

    async def remove_plugin(self, name: str) -> None:
        """Remove the plugin ``name`` (``KeyError`` if there is none) after its ``close()``."""
        plugin = self.plugins.pop(name)
        await call_async(plugin, "close")

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

    def identity(self, comm: Comm | None = None, n_workers: int = -1) -> dict[str, Any]:
        """The scheduler and its workers (the first ``n_workers`` of them; -1: all)."""
        workers = list(self.state.workers.values())
        return {
            "type": "Scheduler",
            "id": self.name,
            "address": self.address,
            "dashboard": self.dashboard_link,
            "n_workers": len(workers),
            "total_threads": sum(ws.nthreads for ws in workers),
            "workers": {
                ws.address: {"type": "Worker", "id": ws.name, "nthreads": ws.nthreads, "host": ws.host,
                             "pid": ws.pid, "name": ws.name, "resources": dict(ws.resources),
                             "languages": sorted(ws.languages),
                             "status": "paused" if ws.paused else "running",
                             "memory": _memory_figures(ws.memory), "memory_limit": ws.memory.get("limit", 0),
                             "nanny": ws.nanny, **({} if ws.ops is None else {"ops": sorted(ws.ops)})}
                for ws in (workers if n_workers < 0 else workers[:n_workers])
            },
        }

    def ncores(self, comm: Comm | None = None, workers: list[str] | None = None) -> dict[str, int]:
        """``{address: nthreads}`` of the workers (of those among ``workers``)."""
        known = self.state.workers
        return {a: known[a].nthreads for a in (known if workers is None else workers) if a in known}

    def who_has(self, comm: Comm | None = None, keys: list[Any] | None = None) -> dict[Any, list[str]]:
        """``{key: [address, ...]}`` of every key, or of ``keys`` (an unknown one: ``[]``)."""
        tasks = self.state.tasks
        if keys is None:
            return {ts.key: sorted(ws.address for ws in ts.who_has) for ts in tasks.values()}
        return {k: sorted(ws.address for ws in tasks[k].who_has) if k in tasks else [] for k in keys}

    def update_data(self, comm: Comm | None = None, who_has: dict[Any, list[str]] | None = None,
                    nbytes: dict[Any, int] | None = None, client: str = "",
                    shm: dict[Any, Any] | None = None) -> None:
        self._apply(UpdateDataEvent(self._stimulus("update-data"), client, who_has or {}, nbytes or {},
                                    shm if isinstance(shm, dict) else {}))

    def get_task_stream(self, comm: Comm | None = None, since: Any = 0, limit: Any = 100_000) -> dict[str, Any]:
        """The task stream's records numbered ``since`` and after (``client.get_task_stream``)."""
        if type(since) is not int or type(limit) is not int or since < 0 or limit < 0:
            raise ValueError(f"since and limit are integers >= 0, got {since!r} and {limit!r}")
        return self.diagnostics.task_stream(since, limit)

    def diagnostics_now(self, comm: Comm | None = None) -> dict[str, Any]:
        """The dashboard's figures now (``performance_report``)."""
        d = self.diagnostics
        return {"summary": d.summary(), "progress": d.progress(), "workers": d.workers(),
                "transfers": d.transfers(), "graph": d.graph(), "next": d.next_index}

    def counters(self, comm: Comm | None = None) -> dict[str, Any]:
        return {
            "payload_deserializations": self.state.payload_deserializations,
            "tasks": self.state.task_counts(),
        }

    async def retire_all(self, comm: Comm | None = None) -> None:
        """Ask every worker to close (the cluster is shutting down)."""
        for stream in list(self.worker_streams.values()):
            try:
                stream.send(to_wire(CloseMsg()))
            except CommError:
                pass

    # -- streams

    async def add_worker(self, comm: Comm, address: str, nthreads: int, host: str = "",
                         pid: int = 0, name: str = "", resources: dict[str, float] | None = None,
                         nanny: str = "", languages: list[str] | None = None, ops: list[str] | None = None,
                         **_: Any) -> None:
        if address in self.worker_streams:
            await _reply_error(comm, f"a worker at {address} is already registered")
            return
        if not isinstance(nthreads, int) or nthreads < 1:
            await _reply_error(comm, f"nthreads must be a positive integer, got {nthreads!r}")
            return
        await comm.write({"status": "OK", "address": self.address})
        stream = BatchedSend(name=f"to-{address}", on_unsendable=partial(self._unsendable_to_worker, address))
        stream.start(comm)
        self.worker_streams[address] = stream
        self.worker_comms[address] = comm
        self.worker_plugins.send_all(stream)  # set up before any task arrives there
        if self.ops.uploads and (ops is None or "upload-file" in ops):
            await self.ops.worker_joins(address)  # files its tasks may import, before any task
        self._apply(AddWorkerEvent(self._stimulus("add-worker"), address, nthreads, host, pid, name,
                                   resources=dict(resources or {}), languages=tuple(languages or ("python",)),
                                   now=time.monotonic()))
        if address in self.state.workers:
            self.state.workers[address].nanny = nanny  # (restart-workers asks it)
            self.state.workers[address].ops = None if ops is None else frozenset(ops)
        logger.info("worker %s joined (%d threads)", address, nthreads)
        self._notify_workers_changed()
        clean = False
        where = f"worker {address}: "
        try:
            while not clean:
                for raw in self._seen(address, await read_batch(comm)):
                    # a malformed message cuts the worker off (it is removed, its tasks
                    # go elsewhere): nothing it sends is dropped silently
                    msg = decode(WORKER_TO_SCHEDULER, raw, where)
                    if type(msg) is UnregisterMsg:
                        clean = True
                    else:
                        self._worker_msg(address, msg)
        except ProtocolError as exc:
            logger.error("%s; closing its connection", exc)
            comm.abort()
        except CommError:
            pass
        finally:
            self.worker_streams.pop(address, None)
            self.worker_comms.pop(address, None)
            self._seen_at.pop(address, None)
            self.holder_checks.worker_left(address)
            stream.abort()
            # a worker removed for its silence was logged then (CloseWorkerStream)
            if not self.closing and address in self.state.workers:
                logger.info("worker %s left%s", address, "" if clean else " (connection lost)")
            self._apply(RemoveWorkerEvent(self._stimulus("remove-worker"), address, crashed=not clean))
            self.diagnostics.worker_left(address)
            self._notify_workers_changed()
            if not clean and host == local_info()["host"] and pid and shm.process_gone(pid):
                # a worker of this host died: nobody else will remove its segments
                removed = shm.sweep(pid)
                if removed:
                    logger.info("removed %d shared-memory segment(s) of dead worker %s", removed, address)

    def _seen(self, address: str, batch: list[Any]) -> list[Any]:
        """Note that worker ``address`` is alive (whatever it sends shows it, not only
        its heartbeats), at most every ``_SEEN_EVERY`` seconds or a twentieth of the
        ttl (a busy worker sends thousands of batches a second; liveness counts in
        seconds); returns ``batch``."""
        now = time.monotonic()
        if now - self._seen_at.get(address, -math.inf) >= self._seen_every:
            self._seen_at[address] = now
            self._apply(HeartbeatEvent(self._stimulus("seen"), address, now))
            self.diagnostics.seen(address)
        return batch

    def _notify_workers_changed(self) -> None:
        if self._workers_changed is not None:
            self._workers_changed.set()

    async def wait_for_workers(self, n: int, timeout: float | None = None) -> None:
        """Wait until at least ``n`` workers are registered; ``TimeoutError`` after
        ``timeout`` seconds."""

        async def wait() -> None:
            while len(self.state.workers) < n:
                # one event for every waiter: the first to see it set makes the next
                if self._workers_changed is None or self._workers_changed.is_set():
                    self._workers_changed = asyncio.Event()
                await self._workers_changed.wait()

        try:
            await asyncio.wait_for(wait(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{len(self.state.workers)} of {n} workers arrived within {timeout}s") from None

    def _worker_msg(self, address: str, msg: Msg) -> None:
        # the worker's own stimulus, when it says (its story and ours then meet)
        sid = getattr(msg, "stimulus_id", "") or self._stimulus(msg.__struct_config__.tag)  # type: ignore[arg-type]
        match msg:
            case TaskFinishedMsg():
                ts = self.state.tasks.get(msg.key)
                self.diagnostics.task_ran(address, msg.key, msg.timing, msg.transfers, True,
                                          ts.group.name if ts is not None and ts.group is not None else None)
                self._apply(TaskFinishedEvent(sid, address, msg.key, msg.nbytes or 0, msg.duration or 0.0,
                                              msg.shm, msg.value))
            case WorkerTaskErredMsg():
                ts = self.state.tasks.get(msg.key)
                self.diagnostics.task_ran(address, msg.key, msg.timing, msg.transfers, False,
                                          ts.group.name if ts is not None and ts.group is not None else None)
                self._apply(TaskErredEvent(sid, address, msg.key, msg.exception, msg.traceback, msg.text))
            case MissingDataMsg():
                self._apply(MissingDataEvent(sid, msg.key, msg.errant_worker, address, msg.unserved))
            case AddReplicaMsg():
                self._apply(ReplicaAddedEvent(sid, address, msg.key, msg.shm))
            case RescheduleMsg():
                self._apply(RescheduleEvent(sid, address, msg.key))
            case LongRunningMsg():
                self._apply(LongRunningEvent(sid, address, msg.key))
            case WorkerMemoryMsg():
                memory = {"limit": msg.limit, "managed": msg.managed, "shm": msg.shm, "spilled": msg.spilled,
                          "unmanaged": msg.unmanaged, "process": msg.process}
                self._apply(WorkerMemoryEvent(sid, address, {k: max(int(v), 0) for k, v in memory.items()},
                                              msg.paused))
                self.diagnostics.worker_figures(address, msg.cpu, msg.transfers_in, msg.transfers_out)
            case HeartbeatMsg():
                pass  # a sign of life, noted for the whole batch (_seen)

    async def add_client(self, comm: Comm, client: str, **_: Any) -> None:
        await comm.write({"status": "OK", "address": self.address, "dashboard": self.dashboard_link})
        # a client process of this host gets back the segments it handed its tasks'
        # arguments over in, once the tasks are forgotten (its next ones reuse them)
        peer_pid = comm.peer_info.get("pid")
        pid = peer_pid if isinstance(peer_pid, int) else 0
        same_host = pid > 0 and pid != os.getpid() and comm.peer_info.get("host") == local_info()["host"]
        if same_host:
            shm_handover.return_to.add(pid)
        stream = BatchedSend(name=f"to-{client}", on_unsendable=without_values)
        stream.start(comm)
        self.client_streams[client] = stream
        self._apply(AddClientEvent(self._stimulus("add-client"), client))
        where = f"client {client}: "
        msg: Msg | None  # None while waiting (below)
        big = False
        try:
            while True:
                closing = False
                for raw in await read_batch(comm):
                    try:
                        msg = decode(CLIENT_TO_SCHEDULER, raw, where)
                    except ProtocolError as exc:
                        if not self._unreadable_graph(client, raw, exc):
                            raise
                        continue
                    if type(msg) is CloseClientMsg:
                        closing = True
                    else:
                        self._client_msg(client, msg)
                        if type(msg) is UpdateGraphMsg and len(msg.tasks) >= _YIELD_AFTER_TASKS:
                            big = True
                # hold no message while waiting for the next: its payloads (and their
                # shared memory) must go when their tasks are forgotten
                raw = msg = None
                if big:
                    # a part of a big graph: let the tasks it started go to their
                    # workers (and their results come in) before the next part
                    big = False
                    await asyncio.sleep(0)
                if same_host:
                    shm.work_off()  # arguments of tasks forgotten just now go back at once
                if closing:
                    break
        except ProtocolError as exc:
            logger.error("%s; closing its connection", exc)
            comm.abort()
        except CommError:
            pass
        finally:
            raw = msg = None
            self.client_streams.pop(client, None)
            if same_host:
                shm_handover.return_to.discard(pid)
            self._apply(RemoveClientEvent(self._stimulus("remove-client"), client))
            self.coordination.client_removed(client)  # its leases, subscriptions, waiters
            await stream.close()
            if same_host:
                # what was given back to a departed client process and never taken in
                shm.work_off()
                await shm.sweep_when_gone(pid)

    def _client_msg(self, client: str, msg: Msg) -> None:
        sid = getattr(msg, "stimulus_id", "") or self._stimulus(msg.__struct_config__.tag)  # type: ignore[arg-type]
        match msg:
            case UpdateGraphMsg():
                tasks = [NewTask(t.key, t.payload, t.deps, t.workers, t.retries, t.priority, t.resources or None,
                                 t.allow_other_workers, t.language, sys.intern(t.once) if t.once else "", t.locate)
                         for t in msg.tasks]
                self._apply(UpdateGraphEvent(sid, client, tasks, msg.wanted))
            case ReleaseKeysMsg():
                self._apply(ReleaseKeysEvent(sid, client, msg.keys))
            case CancelKeysMsg():
                self._apply(CancelKeysEvent(sid, client, msg.keys))
            case FireAndForgetMsg():
                self._apply(FireAndForgetEvent(sid, msg.keys))
            case HeartbeatMsg():
                pass
            case _ if isinstance(msg, COORDINATION_STREAM):
                self.coordination.stream_msg(client, msg)

    def _unreadable_graph(self, client: str, raw: Any, exc: ProtocolError) -> bool:
        """A graph the scheduler cannot read errs its wanted keys (those that are keys)
        with GraphError, so that the client's futures finish; returns False for any
        other malformed message."""
        if type(raw) is not dict or raw.get("op") != "update-graph":
            return False
        logger.error("%s", exc)
        wanted = raw.get("wanted")
        sid = self._stimulus("update-graph")
        for key in wanted if type(wanted) is list else []:
            if key_problem(key) is None:
                self._do(ClientMsg(sid, client, to_wire(TaskErredMsg(
                    key, text=f"GraphError: the scheduler could not read this graph: {exc}",
                    kind="GraphError", blame=key,
                ))))
        return True

    # -- instructions

    def _apply(self, event: Any) -> None:
        log = self.state.log.transitions
        last = log[-1] if self.plugins and log else None
        try:
            instructions = self.state.handle(event)
        except Exception as exc:  # noqa: BLE001 - a bug of the state machine's, never bad input
            self._internal_error(event, exc)
            return
        if self.plugins:
            tell_plugins(self, event, instructions, last)
        # free-keys to one worker merge into one message, sent before anything else
        # that goes to that worker, so the worker sees them in the order made
        free: dict[str, list[Any]] = {}
        for inst in instructions:
            if isinstance(inst, FreeKeys):
                free.setdefault(inst.worker, []).extend(inst.keys)
                continue
            if isinstance(inst, ComputeTask) and inst.worker in free:
                self._send_worker(inst.worker, to_wire(FreeKeysMsg(free.pop(inst.worker), event.stimulus_id)),
                                  lazy=True)
            self._do(inst)
        for worker, keys in free.items():
            # releases need no write of their own: they go with the next task or soon after
            self._send_worker(worker, to_wire(FreeKeysMsg(keys, event.stimulus_id)), lazy=True)

    def _internal_error(self, event: Any, exc: Exception) -> None:
        """``handle(event)`` raised: a bug (peers' input is checked where it is
        decoded). It is reported with the stories of the event's keys. If the state
        still holds together (``validate()``), those keys err with an error that says
        what happened and the scheduler goes on; otherwise it stops, rather than keep
        scheduling from a state that is half changed."""
        keys = keys_of(event)
        text = internal_error("scheduler", exc, self.state.log, keys)
        try:
            self.state.validate()
        except Exception as broken:  # noqa: BLE001 - whatever validate() finds
            logger.critical("the scheduler's state does not hold after that (%s): the scheduler stops",
                            describe(broken))
            if not self.closing:
                asyncio.ensure_future(self.close())
            return
        if keys:
            first = text.splitlines()[0]
            self._apply(FailKeysEvent(self._stimulus("internal-error"), keys,
                                      f"InternalError: {first} (stimulus {event.stimulus_id})"))

    def _do(self, inst: Instruction) -> None:
        if isinstance(inst, ComputeTask):
            payload = self._payload_for(inst)
            if payload is not None:
                self._send_worker(inst.worker, ComputeTaskMsg(
                    inst.key, payload, inst.who_has, inst.nbytes, list(inst.priority),
                    shm=inst.shm or None, report=inst.report, stimulus_id=inst.stimulus_id,
                    resources=inst.resources, locate=inst.locate, local=inst.local,
                ))
        elif isinstance(inst, CloseWorkerStream):
            if inst.why:
                logger.warning("%s; its tasks go elsewhere", inst.why)
            else:
                logger.warning("worker %s was silent for %.1f s (worker-ttl is %g s): removed; its tasks go elsewhere",
                               inst.worker, inst.silent_for, self.state.worker_ttl)
            stream = self.worker_streams.get(inst.worker)
            if stream is not None:
                # its handler then sees the connection end, as for a worker that died
                stream.abort()
        elif isinstance(inst, FreeKeys):
            self._send_worker(inst.worker, to_wire(FreeKeysMsg(inst.keys, inst.stimulus_id)), lazy=True)
        elif isinstance(inst, Warn):
            logger.warning("%s (stimulus %s)", inst.text, inst.stimulus_id)
        elif isinstance(inst, CheckHolder):
            self.holder_checks.start(inst)
        elif isinstance(inst, ClientMsg):
            stream = self.client_streams.get(inst.client)
            if stream is not None:
                try:
                    stream.send(inst.msg)
                except CommError:
                    pass

    def _payload_for(self, inst: ComputeTask) -> Any:
        """The task's payload as its worker gets it. A payload whose shared-memory
        references it cannot reach is sent as frames (forwarded here, once): if those
        references are broken, the task errs (None is returned) instead of the stream
        that would carry it failing, which would cut that worker off."""
        payload = inst.payload
        comm = self.worker_comms.get(inst.worker)
        if type(payload) is not Serialized or comm is None or comm.destination != REMOTE:
            return payload
        try:
            return forwarded(payload, REMOTE)
        except Exception as exc:
            text = f"SerializationError: the task's payload cannot be sent to {inst.worker}: {type(exc).__name__}: {exc}"
            logger.error("task %r: %s", inst.key, text)
            self._apply(TaskErredEvent(self._stimulus("unsendable"), inst.worker, inst.key, None, None, text))
            return None

    def _unsendable_to_worker(self, address: str, msg: Any, error: SerializationError) -> Any:
        """A message to worker ``address`` that cannot be serialized for it: a task
        whose payload came by reference from a client of this process holds a value that
        does not pickle. That task errs (the worker never hears of it); other messages
        carry no user values and are only logged."""
        if isinstance(msg, dict) and msg.get("op") == "compute-task":
            key = msg.get("key")
            text = f"SerializationError: task {short_repr(key)} cannot be sent to {address}: {error}"
            logger.warning("%s", text)
            self._apply(TaskErredEvent(self._stimulus("unsendable"), address, key, None, None, text))
            return None
        logger.error("dropped a %r message to %s that cannot be serialized: %s",
                     msg.get("op") if isinstance(msg, dict) else type(msg).__name__, address, error)
        return None

    def _send_worker(self, address: str, msg: Msg | dict[str, Any], lazy: bool = False) -> None:
        """Send ``msg`` on the stream of worker ``address`` (a struct goes as it is to
        a worker of this process, else as its map)."""
        stream = self.worker_streams.get(address)
        if stream is None:
            return
        if type(msg) is not dict:
            comm = self.worker_comms.get(address)
            msg = for_destination(msg, comm.destination if comm is not None else REMOTE)  # type: ignore[arg-type]
        try:
            stream.send(msg, lazy=lazy)
        except CommError:
            pass  # its stream handler will remove the worker

    async def close(self) -> None:
        self.closing = True
        if self.dashboard is not None:
            await self.dashboard.close()  # first: its pages read the state that closing changes
        for name in list(self.plugins):
            await self.remove_plugin(name)
        if self._liveness is not None:
            self._liveness.cancel()  # workers that stop talking now are closing
        for listener in self.server.listeners:
            security.unregister(listener.contact_address)
        self.coordination.close()
        self.holder_checks.close()
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
        if self._gc_held:
            self._gc_held = False
            gcpolicy.release()


async def _reply_error(comm: Comm, text: str) -> None:
    logger.error(text)
    try:
        await comm.write({"status": "error", "message": text, "type": "ValueError",
                          "traceback": "", "exception": None})
    except CommError:
        pass
    comm.abort()
