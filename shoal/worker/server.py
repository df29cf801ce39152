"""The worker's IO: an event loop thread for comms, the state machine and serving data;
executor threads for tasks.

Input from peers is checked where it is decoded; beyond that, an exception while the
state machine handles an event (or while its instructions are carried out) is a bug of
shoal's: it is reported with the stories of the keys involved
(:func:`shoal.statelog.internal_error`) and the worker closes, as if it had died,
rather than go on with a state that may be half-changed. Its scheduler computes its
tasks elsewhere; a nanny (a :class:`~shoal.LocalCluster` with processes) starts a new
worker.

The loop never runs user code. Tasks run in a thread pool of ``nthreads`` threads;
their payloads are deserialized there too (with the function cache), so a payload that
cannot be deserialized fails that one task with the real exception. Peers' ``get-data``
requests are served from the loop while tasks compute.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import socket
import tempfile
import time
from functools import partial
from typing import Any

from ..comm import Comm, connect
from ..comm.security import Security
from ..comm.core import local_info
from ..errors import CommError, CorruptedDataError, ProtocolError, describe, short_repr
from .. import config, gcpolicy
from ..statelog import internal_error, keys_of
from ..comm import shm, shm_born, shm_family, shm_handover
from ..protocol import SAME_HOST, SAME_PROCESS, Serialize, Serialized, deserialize, sizeof, to_serialize
from ..protocol.serialize import sizes
from ..rpc import BatchedSend, ConnectionPool, Server, read_batch, without_values
from ..protocol.resources import check_resources
from ..protocol.messages import (
    SCHEDULER_TO_WORKER,
    WORKER_REQUESTS,
    CloseMsg,
    ComputeTaskMsg,
    FreeKeysMsg,
    Msg,
    PluginAddMsg,
    decode,
)
from ..taskspec import RunSpec, run, takes_parameter
from . import actor, context, shuffle, upload
from .plugin import add_plugin, call_hook, plugin_add, plugin_remove, remove_plugin, tell_transitions, unwrap_plugin
from .memory import Thresholds, parse_memory_limit
from .diagnostics import CpuMeter, Traffic
from .monitor import MemoryMonitor, memory_report
from .store import WorkerStore
from .outcomes import raised_while_importing, failure_event, inline_value
from .peers import PeerData, WaitingRequest
from .threads import TaskThreads
from .state import (
    AttachShm,
    ComputeTaskEvent,
    DataLostEvent,
    Execute,
    ExecuteFailureEvent,
    ExecuteSuccessEvent,
    FreeKeysEvent,
    GatherDep,
    Instruction,
    Rejoin,
    MemoryTightEvent,
    PauseEvent,
    SendMsg,
    UnpauseEvent,
    UpdateDataEvent,
    WorkerState,
)

__all__ = ["Worker"]


def _pooled_bytes() -> int:
    """Bytes of the retired segments this process keeps for reuse."""
    return sum(size for size, _ in shm.registry.pooled())

logger = logging.getLogger("shoal.worker")

class Worker(PeerData):
    """A worker that joins the scheduler at ``scheduler_address``, with ``nthreads``
    task threads and the abstract ``resources`` it offers (``{"GPU": 2}``: tasks that
    ask for them run here, as many at once as the amounts allow). Raises ``ValueError``
    for fewer than one thread or a malformed ``resources`` (``TypeError`` for one that
    is not a dict of str -> number)."""

    def __init__(self, scheduler_address: str, nthreads: int = 1, name: str = "",
                 listen_address: str | None = None, security: Security | None = None,
                 resources: dict[str, float] | None = None, memory_limit: Any = None,
                 local_directory: str | None = None, work_dir: str | None = None, nanny: str = ""):
        if nthreads < 1:
            raise ValueError(f"nthreads must be at least 1, got {nthreads}")
        resources = check_resources(resources)
        #: bytes, or None: no limit (see :func:`shoal.worker.memory.parse_memory_limit`)
        self.memory_limit = parse_memory_limit(memory_limit)
        #: where this worker makes its own directory (spilled values); None: the
        #: ``local-directory`` setting, else the system's temporary directory
        self.local_directory = local_directory
        #: the directory this worker owns, made for it by its nanny (None: it makes one
        #: under ``local_directory`` at start and removes it when it closes)
        self.work_dir = work_dir
        #: the address of the nanny that runs this worker's process ("" : none)
        self.nanny = nanny
        #: abstract resources this worker offers
        self.resources = resources
        self.scheduler_address = scheduler_address
        self.nthreads = nthreads
        self.name = name
        if listen_address is None:
            scheme = scheduler_address.split("://")[0] if "://" in scheduler_address else "tcp"
            listen_address = "inproc://" if scheme == "inproc" else f"{scheme}://127.0.0.1:0"
        self.listen_address = listen_address
        #: the cluster's credentials (None: found for the scheduler's address at start)
        self.security = security
        self.server = Server(
            {
                "get-data": self.get_data,
                "has-keys": self.has_keys,
                "get-slices": self.get_slices,
                "split-outputs": self.split_outputs,
                "update-data": self.update_data,
                "run": self.run_function,
                "identity": self.identity,
                "transfer-stats": self.transfer_stats,
                "actor-execute": partial(actor.actor_execute, self),
                "actor-attribute": partial(actor.actor_attribute, self),
                "plugin-add": partial(plugin_add, self),
                "plugin-remove": partial(plugin_remove, self),
                "upload-file": upload.upload_file,
            },
            name=f"worker {name}",
            schemas=WORKER_REQUESTS,
            role="worker",
        )
        self.state: WorkerState | None = None
        self.threads = TaskThreads(nthreads, name=f"shoal-task{('-' + name) if name else ''}",
                                   initializer=self._task_thread_started)
        #: WorkerPlugins by name (:meth:`add_plugin`)
        self.plugins: dict[str, Any] = {}
        #: what its tasks ask of it: a client, leaving and rejoining the thread pool
        self.services = context.TaskServices(self)
        self.pool = ConnectionPool(limit=64, role="worker")
        self.stream: BatchedSend | None = None
        self.scheduler_comm: Comm | None = None
        self._ids = itertools.count()
        self._tasks: set[asyncio.Future[Any]] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Future[None] | None = None
        #: whether it holds the collector's policy of this process (shoal.gcpolicy)
        self._gc_held = False
        self.status = "created"
        self.store = WorkerStore()
        self.monitor: MemoryMonitor | None = None
        self._shm_warned = False
        self.use_shm = False
        self._born_in_shm = False
        #: bytes of values this worker sent or received, by how they travelled
        #: bytes moved by path, and the inputs moved here for the task stream
        self.traffic = Traffic()
        #: get-data requests waiting for keys this worker is fetching
        self._awaited: list[WaitingRequest] = []
        self._cpu = CpuMeter()
        #: the state machine failed (a bug): it gets no more events, the worker closes
        self.broken = False
        #: the scheduler connection broke without the scheduler telling this worker to
        #: close (``shoal worker`` then waits for a scheduler at that address again)
        self.scheduler_lost = False

    @property
    def _scheduler_destination(self) -> str:
        """Where values reported to the scheduler go (how exceptions are serialized)."""
        return self.scheduler_comm.destination if self.scheduler_comm else SAME_PROCESS

    @property
    def address(self) -> str:
        return self.server.address

    async def start(self) -> Worker:
        self.loop = asyncio.get_running_loop()
        self._stopped = self.loop.create_future()
        comm = await connect(self.scheduler_address, deserialize=False, security=self.security,
                             role="worker", expect="scheduler")
        if self.security is None:
            self.security = comm.security  # what was found for the scheduler's address
        # peers prove the cluster's secret to this worker as to the scheduler
        self.server.security = self.security or Security.disabled()
        self.pool.security = self.server.security
        try:
            await self.server.listen(self.listen_address)
        except BaseException:
            comm.abort()
            raise
        self.store = self._make_store(own_process=comm.destination != SAME_PROCESS)
        self.state = WorkerState(self.address, self.nthreads, data=self.store,
                                 queued=config.get("executor-queue"),
                                 max_peer_failures=max(1, config.get("gather-peer-failures")),
                                 resources=self.resources,
                                 transfer_bytes=self._transfer_bytes())
        register: dict[str, Any] = {
            "op": "register-worker", "address": self.address, "nthreads": self.nthreads,
            "host": local_info()["host"], "pid": os.getpid(), "name": self.name or self.address,
            "languages": ["python"],
        }
        if self.resources:
            register["resources"] = self.resources
        if self.nanny:
            register["nanny"] = self.nanny
        await comm.write(register)
        reply = await comm.read()
        if not isinstance(reply, dict) or reply.get("status") != "OK":
            comm.abort()
            await self.server.close()
            raise RuntimeError(f"the scheduler refused this worker: {reply!r:.200}")
        self.scheduler_comm = comm
        # results go to shared memory when this worker is a process of its own
        self.use_shm = shm.enabled() and comm.destination != SAME_PROCESS
        if self.use_shm:
            shm.registry.adopt_transfers = True  # values sent here (scatter, fetches) stay mappable
            # the memory of released results kept for reuse is this worker's memory too
            limit = config.get("shm-pool-bytes")
            if self.memory_limit is not None:
                limit = min(limit, self.memory_limit // 8)
            shm.registry.pool_limit = limit
        threshold = config.get("shm-alloc-threshold")
        self._born_in_shm = self.use_shm and threshold > 0 and shm_born.enable_array_allocator(threshold)
        if self.use_shm and config.get("shm-pool-idle") > 0:
            self._spawn(self._trim_pool(config.get("shm-pool-idle")))
        self.stream = BatchedSend(name="to-scheduler", on_unsendable=without_values)
        self.stream.start(comm)
        self._spawn(self._read_scheduler(comm))
        if self.monitor is not None and config.get("memory-monitor-interval") > 0:
            self._spawn(self._watch_memory(config.get("memory-monitor-interval")))
        # the memory report is this worker's heartbeat
        self._report_memory()
        if config.get("heartbeat-interval") > 0:
            self._spawn(self._report_memory_every(config.get("heartbeat-interval")))
        self.status = "running"
        self._gc_held = True
        gcpolicy.hold()
        return self

    # -- memory (shoal.worker.monitor)

    def _transfer_bytes(self) -> int | None:
        """The bytes this worker fetches from peers at once: ``memory-transfer`` of its
        memory limit (None: no limit, or that rule off)."""
        fraction = float(config.get("memory-transfer"))
        if self.memory_limit is None or fraction <= 0:
            return None
        return max(1, int(fraction * self.memory_limit))

    def _make_store(self, own_process: bool) -> WorkerStore:
        """The store of this worker's values: with a memory limit, one that spills
        past the target into a directory of this worker's own (``own_process``: no
        other worker shares this process, so its memory is this worker's)."""
        if self.memory_limit is None:
            return WorkerStore()
        if self.work_dir is None:
            base = self.local_directory or config.get("local-directory") or tempfile.gettempdir()
            os.makedirs(base, exist_ok=True)
            self.work_dir = tempfile.mkdtemp(prefix="shoal-worker-", dir=base)
        thresholds = Thresholds.from_config(self.memory_limit)
        store = WorkerStore(target=thresholds.target, directory=os.path.join(self.work_dir, "spill"))
        self.monitor = MemoryMonitor(store, thresholds, own_process, self._set_paused,
                                     give_back=self._give_back_pool if own_process else None,
                                     pooled=_pooled_bytes if own_process else None,
                                     tight=self._set_tight)
        return store

    def _give_back_pool(self) -> None:
        if self.use_shm:
            shm.work_off()
            shm.drain_pool()

    async def _watch_memory(self, interval: float) -> None:
        assert self.monitor is not None
        while self.status in ("created", "running"):
            await asyncio.sleep(interval)
            if self.status == "running" and not self.broken:
                try:
                    self.monitor.check()
                except OSError as exc:  # /proc unreadable now (no descriptor left): the next look
                    logger.debug("cannot read this process's memory: %s", describe(exc))

    def _set_paused(self, paused: bool) -> None:
        if paused:
            self.threads.hold()  # tasks handed ahead wait in the pool too
        else:
            self.threads.release()
        self.handle_stimulus((PauseEvent if paused else UnpauseEvent)(self._stimulus("pause" if paused else "unpause")))
        self._report_memory()

    def _set_tight(self, tight: bool) -> None:
        self.handle_stimulus(MemoryTightEvent(self._stimulus("memory-tight"), tight))

    @property
    def paused(self) -> bool:
        return self.monitor is not None and self.monitor.paused

    def memory(self) -> dict[str, int]:
        """This worker's memory in bytes: ``limit`` (0: none), ``managed``, ``shm``,
        ``spilled``, ``unmanaged``, ``process`` (:func:`shoal.worker.monitor.memory_report`)."""
        own_process = self._scheduler_destination != SAME_PROCESS
        return memory_report(self.store, self.memory_limit, own_process)

    def _report_memory(self, lazy: bool = False) -> None:
        """Tell the scheduler this worker's memory (``lazy``: with the next batch)."""
        msg: dict[str, Any] = {"op": "worker-memory", **self.memory(), "cpu": self._cpu.read(),
                               **self.traffic.report()}
        if self.paused:
            msg["paused"] = True
        if self.stream is not None:
            try:
                self.stream.send(msg, lazy=lazy)
            except CommError:
                pass

    async def _report_memory_every(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self._report_memory(lazy=True)

    async def _trim_pool(self, idle: float) -> None:
        """Give back the memory of retired segments that sat unused for ``idle`` seconds."""
        while True:
            await asyncio.sleep(idle / 2)
            shm.work_off()
            shm.trim_pool(idle)

    def _task_thread_started(self) -> None:
        if self._born_in_shm:
            # large arrays of tasks come from retired segments: no page faults to make
            # them, no copy to publish them
            shm_born.use_array_allocator()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _stimulus(self, what: str) -> str:
        return f"{what}-{next(self._ids)}"

    # -- the scheduler stream

    async def _read_scheduler(self, comm: Comm) -> None:
        # None while waiting (below)
        events: list[ComputeTaskEvent | FreeKeysEvent] | None
        msg: Msg | None
        try:
            while True:
                events = []
                for raw in await read_batch(comm):
                    msg = decode(SCHEDULER_TO_WORKER, raw, "the scheduler: ")
                    match msg:
                        case ComputeTaskMsg():
                            self.traffic.payload(msg.payload)
                            # the scheduler's stimulus, when it says: its story and ours meet
                            events.append(ComputeTaskEvent(
                                msg.stimulus_id or self._stimulus("compute"), msg.key, msg.payload, msg.who_has,
                                msg.nbytes, tuple(msg.priority) or (0,), msg.shm or {}, msg.report,
                                msg.resources or None, msg.locate, msg.local,
                            ))
                        case FreeKeysMsg():
                            events.append(FreeKeysEvent(msg.stimulus_id or self._stimulus("free"), msg.keys))
                        case CloseMsg():
                            if events:
                                self.handle_stimulus(*events)
                            await self.close(report=False)
                            return
                        case PluginAddMsg():
                            # set up before what follows it on the stream (in order)
                            if events and not self.handle_stimulus(*events):
                                return
                            events = []
                            try:
                                await self.add_plugin(unwrap_plugin(msg.plugin), msg.name)
                            except Exception as exc:  # noqa: BLE001 - the plugin does not unpickle here
                                logger.error("worker plugin %s cannot be set up here: %s", msg.name, describe(exc))
                if events and not self.handle_stimulus(*events):
                    return  # broken: closing
                # hold no message (nor a task's payload) while waiting for the next
                events = raw = msg = None
                if self.use_shm:
                    shm.work_off()  # segments of values freed just now go back to the pool
        except (CommError, ProtocolError) as exc:
            if isinstance(exc, ProtocolError):
                logger.error("%s; leaving the cluster", exc)
            if self.status == "running":
                self.scheduler_lost = True
                logger.warning("lost the scheduler connection; shutting down")
                if self.use_shm:
                    await self._sweep_after(comm)  # before closing: the process may exit then
                await self.close(report=False)

    async def _sweep_after(self, comm: Comm) -> None:
        """A scheduler process of this host that died leaves task arguments in segments
        named after it (:mod:`shoal.taskspec`), which nobody else would remove."""
        info = comm.peer_info
        pid = info.get("pid")
        if not isinstance(pid, int) or pid == os.getpid() or info.get("host") != local_info()["host"]:
            return
        removed = await shm.sweep_when_gone(pid)
        if removed:
            logger.info("removed %d shared-memory segment(s) of the dead scheduler (pid %d)", removed, pid)

    # -- state machine driving

    def handle_stimulus(self, *events: Any) -> bool:
        """Hand ``events`` to the state machine and carry out its instructions; returns
        whether that went through. An exception in either is a bug (the events' input
        was checked when it was decoded): it is reported with the stories of the events'
        keys, and the worker closes (``False``); a broken worker takes no more events."""
        state = self.state
        assert state is not None
        if self.broken:
            return False
        log = state.log.transitions
        last = log[-1] if self.plugins and log else None
        try:
            instructions = state.handle(*events)
        except Exception as exc:
            self._internal_error(exc, events)
            return False
        if self.plugins:
            tell_transitions(self.plugins, log, last)
        for inst in instructions:
            try:
                self._do(inst)
            except Exception as exc:
                if self.status != "running":
                    # closing: the executor and the streams go away under us
                    logger.debug("while closing, %s was not carried out: %s", type(inst).__name__, describe(exc))
                    continue
                self._internal_error(exc, events)
            if self.broken:
                return False  # (an instruction that applied events of its own failed)
        if self._awaited:
            self._wake_awaited()
        return True

    def _internal_error(self, exc: Exception, events: tuple[Any, ...]) -> None:
        """A bug met while handling ``events``: report it (logged at CRITICAL with the
        stories of their keys, kept in :data:`shoal.statelog.internal_errors`), and
        close this worker as if it had died (no ``unregister``: the scheduler counts the
        tasks it ran as suspicious, so a task that breaks every worker errs at last)."""
        assert self.state is not None
        self.broken = True
        internal_error("worker", exc, self.state.log, keys_of(*events))
        if self.status == "running":
            logger.critical("worker %s closes after an internal error", self.address)
            self._spawn(self.close(report=False))

    def _do(self, inst: Instruction) -> None:
        if isinstance(inst, Execute):
            self._execute(inst.key)
        elif isinstance(inst, Rejoin):
            self.services.rejoined(inst.key)
        elif isinstance(inst, AttachShm):
            self._attach(inst)
        elif isinstance(inst, GatherDep):
            self._spawn(self._gather_dep(inst))
        elif isinstance(inst, SendMsg):
            self._send(inst.msg)

    def _send(self, msg: dict[str, Any]) -> None:
        if self.stream is None:
            return
        try:
            self.stream.send(msg)
        except CommError:
            pass

    def _inputs(self, key: Any) -> dict[Any, Any] | None:
        """The values of task ``key``'s inputs, read back from disk where spilled; or
        ``None`` when one cannot be (the task goes back to the scheduler then: see
        :class:`~shoal.worker.events.DataLostEvent`)."""
        assert self.state is not None
        data = self.state.data
        deps: dict[Any, Any] = {}
        lost: list[Any] = []
        for d in self.state.tasks[key].dependencies:
            if d.key not in data:
                continue
            try:
                deps[d.key] = data[d.key]
            except CorruptedDataError as exc:  # its spill file, or its segment (shm-verify)
                logger.error("%s; it is computed again", exc)
                lost.append(d.key)
            except (OSError, MemoryError) as exc:  # may pass (out of descriptors): the task goes back
                logger.warning("cannot read the inputs of %s back from disk now (%s); giving it back to "
                               "the scheduler", short_repr(key), describe(exc))
                self.handle_stimulus(DataLostEvent(self._stimulus(f"inputs-unreadable-{key}"), lost, key))
                return None
        if lost:
            self.handle_stimulus(DataLostEvent(self._stimulus(f"data-lost-{key}"), lost, key))
            return None
        return deps

    def _execute(self, key: Any) -> None:
        assert self.state is not None and self.loop is not None
        ts = self.state.tasks.get(key)
        if ts is None or ts.state != "executing" or ts not in self.state.executing:
            return  # sent back meanwhile: an input of an earlier Execute of this batch was lost
        if ts.located is not None:  # it runs on where its inputs are, not on their values
            deps: dict[Any, Any] | None = {k: shuffle.Location(k, tuple(holders), nbytes, segment)
                                           for k, (holders, nbytes, segment) in ts.located.items()}
        else:
            deps = self._inputs(key)
        if deps is None:
            return
        payload = ts.payload
        loop = self.loop
        destination = self._scheduler_destination
        place = self.use_shm and not ts.local
        fits = self.store.fits if self.monitor is None else self.monitor.fits
        report = ts.report
        transfers = self.traffic.arrivals.take(deps) or None
        threads = self.threads

        def work() -> None:
            if ts.state != "executing":
                # released while it waited for a thread: report at once, run nothing
                report_back(ExecuteFailureEvent(self._stimulus(f"task-skipped-{key}"), key, None, "",
                                                "released before it ran"), None)
                return
            segment: shm.Segment | None = None
            event: ExecuteSuccessEvent | ExecuteFailureEvent
            began = 0.0
            # get_worker()/get_client() work from here on: in the task, and while its
            # arguments unpickle (a Future among them binds to this worker's client)
            context.enter_task(self, key)
            try:
                try:
                    for attempt in (1, 2):
                        try:
                            spec = payload
                            if isinstance(spec, Serialize):
                                spec = spec.data
                            elif isinstance(spec, Serialized):
                                spec = deserialize(spec)
                            if not isinstance(spec, RunSpec):
                                raise TypeError(f"task {key!r} has no runnable payload (got {type(spec).__name__})")
                            began = time.time()
                            start = time.perf_counter()
                            value = run(spec, deps)
                            break
                        except Exception as exc:
                            # an import that met another thread's half-done one (see
                            # raised_while_importing) is done again once; a module that
                            # is really missing fails the same way twice
                            if attempt == 2 or not raised_while_importing(exc):
                                raise
                    # a task that seceded computed until then; the rest it waited
                    duration = (context.seceded_at() or time.perf_counter()) - start
                except BaseException as exc:  # noqa: BLE001 - user code may raise anything
                    event = failure_event(self._stimulus(f"task-erred-{key}"), key, exc, destination)
                    event.timing = (began or time.time(), time.time(), threads.index())
                    event.transfers = transfers
                else:
                    try:
                        # (the store's measure too, taken here, off the event loop)
                        nbytes, managed = sizes(value)
                    except BaseException as exc:  # noqa: BLE001 - the result's nbytes/__sizeof__
                        exc.add_note(f"(raised while shoal measured the result of task {short_repr(key)}: "
                                     "its nbytes or __sizeof__)")
                        raise
                    # a result that will go to disk soon is not worth a segment: spilling
                    # would write it out and unlink that segment again
                    placed = self._place(value) if place and fits(nbytes) else None
                    if placed is not None:
                        segment, value = placed
                    # (a value in a segment counts by the segment's size)
                    inline = inline_value(value, nbytes, destination) if report else None
                    event = ExecuteSuccessEvent(self._stimulus(f"task-finished-{key}"), key, value, nbytes, duration,
                                                None if segment is None else segment.info, inline,
                                                (began, began + duration, threads.index()), transfers,
                                                managed if placed is None else None)
            except BaseException as exc:  # noqa: BLE001 - whatever a result made us raise is its task's
                if segment is not None:
                    segment.unlink()
                    segment = None
                event = failure_event(self._stimulus(f"task-erred-{key}"), key, exc, destination)
            finally:
                context.leave_task()
            report_back(event, segment)

        def report_back(event: Any, segment: shm.Segment | None) -> None:
            try:
                loop.call_soon_threadsafe(self._apply_result, event, segment)
            except RuntimeError:
                if segment is not None:
                    segment.unlink()  # the worker's loop is gone

        self.threads.submit(work, ts.priority)

    # -- tasks that use the cluster (shoal.worker.context)

    @property
    def client(self) -> Any:
        """The client of this worker's tasks (as ``get_client()`` in a task): see
        :meth:`shoal.worker.context.TaskServices.client`."""
        return self.services.client()

    def call_soon(self, fn: Any, *args: Any) -> bool:
        """Run ``fn(*args)`` on the worker's loop, from any thread; returns False if the
        loop is gone (or not started)."""
        loop = self.loop
        if loop is None:
            return False
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            return False
        return True

    # -- plugins

    async def add_plugin(self, plugin: Any, name: str | None = None, catch_errors: bool = True) -> None:
        """Add a :class:`~shoal.WorkerPlugin`: see :func:`shoal.worker.plugin.add_plugin`."""
        await add_plugin(self, plugin, name, catch_errors)

    async def remove_plugin(self, name: str) -> None:
        """Remove the plugin ``name``: see :func:`shoal.worker.plugin.remove_plugin`."""
        await remove_plugin(self, name)

    # -- rpc handlers

    def _place(self, value: Any) -> tuple[shm.Segment, Any] | None:
        """Put a large result in shared memory (in the task's thread, before it is
        reported, so that same-host peers never need this worker to serve it)."""
        try:
            return shm.place(value, config.get("shm-threshold"))
        except (shm.ShmUnavailable, OSError, MemoryError) as exc:
            # no room (a full /dev/shm, ENOMEM mapping it): the value stays private
            if not self._shm_warned:
                self._shm_warned = True
                logger.warning("a result stays in this worker's private memory: %s", describe(exc))
            return None
        except Exception as exc:  # noqa: BLE001 - the value does not pickle: it cannot leave this process
            logger.debug("a result stays in private memory: %s", describe(exc))
            return None

    def _apply_result(self, event: Any, segment: Any) -> None:
        if self.monitor is not None and isinstance(event, ExecuteSuccessEvent):
            self.monitor.result_arrives(event.nbytes)
        if segment is not None:
            self.store.expect(event.key, segment)
        try:
            self.handle_stimulus(event)
        finally:
            if segment is not None:
                self.store.unexpect(event.key)  # no-op when the store took the value

    def identity(self, comm: Comm | None = None) -> dict[str, Any]:
        return {"address": self.address, "nthreads": self.nthreads, "name": self.name,
                "pid": os.getpid(), "host": socket.gethostname()}

    def update_data(self, comm: Comm, data: dict[Any, Any]) -> dict[str, Any]:
        values = {k: (v.data if isinstance(v, Serialize) else v) for k, v in data.items()}
        nbytes = {k: sizeof(v) for k, v in values.items()}
        self.traffic.pushed(comm.destination, nbytes, values)
        if not self.handle_stimulus(UpdateDataEvent(self._stimulus("update-data"), values, nbytes)):
            raise RuntimeError(f"worker {self.address} met an internal error and is closing; "
                               f"{short_repr(list(values), 200)} not stored")
        reply: dict[str, Any] = {"nbytes": nbytes}
        if self.use_shm and comm.destination == SAME_HOST:
            # values kept in the segments they came in: same-host peers may map them
            # without this worker, like results (the scheduler hands the info on)
            infos = {k: info for k, v in values.items()
                     if nbytes[k] >= shm_family.TRANSFER_MIN_BYTES and (info := shm_handover.describe_kept(v))}
            if infos:
                reply["shm"] = infos
        return reply

    async def run_function(self, comm: Comm, function: Any, args: Any = (), kwargs: Any = None) -> Any:
        """``Client.run``: call ``function`` here (on the loop); a function with a
        ``dask_worker`` parameter gets this worker in it, as in dask.distributed."""
        function, args, kwargs = (v.data if isinstance(v, Serialize) else v for v in (function, args, kwargs))
        kwargs = dict(kwargs or {})
        if "dask_worker" not in kwargs and takes_parameter(function, "dask_worker"):
            kwargs["dask_worker"] = self
        result = function(*(args or ()), **kwargs)
        if asyncio.iscoroutine(result):
            result = await result
        return to_serialize(result)

    # -- closing

    async def close(self, report: bool = True) -> None:
        """Close the worker (``report``: tell the scheduler first); returns once it is
        closed, also when it was closing already."""
        if self.status in ("closing", "closed"):
            if self._stopped is not None:
                await asyncio.shield(self._stopped)
            return
        self.status = "closing"
        await self.services.aclose()
        for plugin in list(self.plugins.values()):
            await call_hook(plugin, "teardown", self)
        self.plugins.clear()
        if self.stream is not None:
            if report:
                try:
                    self.stream.send({"op": "unregister"})
                except CommError:
                    pass
            await self.stream.close(timeout=2.0)
        await self.server.close()
        await self.pool.close()
        for task in list(self._tasks):
            if task is not asyncio.current_task():
                task.cancel()
        self.threads.shutdown()
        self.services.wake_all()
        self.store.clear()
        if self.work_dir is not None:
            # its spilled values go with it (a nanny removes it too, after a crash)
            shutil.rmtree(self.work_dir, ignore_errors=True)
        self.threads.release()
        if self._gc_held:
            self._gc_held = False
            gcpolicy.release()
        self.status = "closed"
        if self._stopped is not None and not self._stopped.done():
            self._stopped.set_result(None)

    async def finished(self) -> None:
        """Wait until the worker has closed."""
        assert self._stopped is not None
        await asyncio.shield(self._stopped)
