"""The client: submit work, hold futures, gather results.

The client talks to the scheduler over one batched stream (graphs and releases go
out, key-in-memory / task-erred notices come back) and fetches values straight from
the workers that hold them. A synchronous client runs its event loop in a background
thread; an asynchronous one (``asynchronous=True``) runs on the caller's loop and its
methods return awaitables.

Task payloads are built as objects (:class:`~shoal.taskspec.RunSpec`) and handed to
the comm: over ``inproc://`` nothing is pickled at all; over ``tcp://`` the comm
serializes them with the function cache. Keys are computed without pickling anything.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import config
from .._loop import LoopThread
from ..comm import Comm, connect, shm, shm_handover
from ..comm.security import Security, dashboard_token
from ..comm.security import for_address as security_for
from ..errors import CommError, ProtocolError
from ..protocol.messages import SCHEDULER_TO_CLIENT, decode
from ..protocol import SAME_HOST, SAME_PROCESS, to_serialize
from ..rpc import BatchedSend, ConnectionPool, PooledRPC, read_batch, send_heartbeats
from .cluster_ops import ClusterOps
from .diagnostics import TaskStreamMethods
from .collections import DaskCollections
from . import dask_methods, graphs
from ..worker.context import waiting
from .default import set_default, unset_default
from .plugins import Plugins
from .worker_plugins import WorkerPluginMethods
from .submit import Submitting
from .coordination import PublishedDatasets
from .future import Future, FutureState, _unwrap
from .gathering import Gathering, serving
from .options import worker_restrictions
from .structure import collect_futures, rebuild_exception

#: the bytes a gather asks of one worker in one request, at most (one value may be more)
__all__ = ["Client"]

logger = logging.getLogger("shoal.client")

class Client(Gathering, Submitting, DaskCollections, PublishedDatasets, Plugins, WorkerPluginMethods, ClusterOps,
             TaskStreamMethods):
    """Connect to a cluster and run work on it.

    ``address`` is a scheduler address or a ``LocalCluster``; with neither, the client
    starts a ``LocalCluster`` of its own (``n_workers``, ``threads_per_worker``,
    ``processes`` and any other keyword of :class:`~shoal.LocalCluster`) and closes it
    on :meth:`close`.
    """

    def __init__(
        self,
        address: Any = None,
        *,
        n_workers: int | None = None,
        threads_per_worker: int | None = None,
        processes: bool = True,
        asynchronous: bool = False,
        timeout: float = 30.0,
        security: Security | None = None,
        set_as_default: bool = True,
        name: str | None = None,
        **cluster_kwargs: Any,
    ):
        self.id = f"{name or 'client'}-{uuid.uuid4().hex[:12]}"
        #: while open, dask's ``.compute()``/``.persist()`` and ``get_client()`` use it
        self.set_as_default = set_as_default
        #: the cluster's credentials (None: the cluster's, or found for the address)
        self.security = security
        self._address_arg = address
        if cluster_kwargs and address is not None:
            raise TypeError(f"Client() got keywords for a cluster of its own ({', '.join(sorted(cluster_kwargs))}) "
                            "with an address: pass them to LocalCluster instead")
        self._cluster_kwargs: dict[str, Any] = {
            "n_workers": n_workers, "threads_per_worker": threads_per_worker, "processes": processes,
            **cluster_kwargs,
        }
        self.asynchronous = asynchronous
        self.timeout = timeout
        self.cluster: Any = None
        self._own_cluster = False
        self.scheduler_address = ""
        self.status = "created"
        self._states: dict[Any, FutureState] = {}
        self._refcount: Counter[Any] = Counter()
        self._outbox: list[dict[str, Any]] = []
        self._flush_due = False  # a flush of the outbox is scheduled on the loop
        self._lazy_due = False  # a delayed flush (for releases alone) is scheduled
        self._lock = threading.Lock()
        self._stream: BatchedSend | None = None
        self._comm: Comm | None = None
        self._reader: asyncio.Task[None] | None = None
        self._heartbeats: asyncio.Task[None] | None = None
        self._pool: ConnectionPool | None = None
        self._callbacks: ThreadPoolExecutor | None = None
        self._loop_thread: LoopThread | None = None
        self._own_loop = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._scatter_rr = itertools.count()
        self._use_shm = False
        self._hand_over = False
        #: tasks' arguments will be pickled (a worker or the scheduler is in another
        #: process): they are checked at submit
        self._pickles_tasks = True
        #: the scheduler's dashboard link, as it said when this client registered
        self._dashboard_link: str | None = None
        #: lets go of dask's methods, held while this client is open (see _start)
        self._dask_methods: Callable[[], Any] | None = None
        if not asynchronous:
            # A client of a cluster running in this process shares the cluster's loop:
            # client and scheduler then talk on one thread (no wake-ups between them).
            shared = getattr(address, "_loop_thread", None)
            if isinstance(shared, LoopThread) and not shared.loop.is_closed():
                self._loop_thread = shared
            else:
                self._loop_thread = LoopThread(name=f"shoal-{self.id}")
                self._own_loop = True
            self.loop = self._loop_thread.loop
            try:
                self._loop_thread.run(self._start(), timeout=timeout + 30)
            except BaseException:
                self._stop_loop(self._close())
                raise

    # -- lifecycle

    async def _start(self) -> Client:
        if self.status == "running":
            return self
        self.loop = asyncio.get_running_loop()
        address = self._address_arg
        if address is None:
            from ..deploy import LocalCluster

            kwargs = {k: v for k, v in self._cluster_kwargs.items() if v is not None}
            self.cluster = await LocalCluster(asynchronous=True, **kwargs)
            self._own_cluster = True
            address = self.cluster.scheduler_address
        elif hasattr(address, "scheduler_address"):
            self.cluster = address
            address = getattr(address, "local_address", "") or address.scheduler_address
        if self.cluster is not None and getattr(self.cluster, "local_address", None):
            # the scheduler lives in this process: talk to it by reference
            address = self.cluster.local_address
        if not isinstance(address, str):
            raise TypeError(f"address must be a scheduler address or a LocalCluster, got {type(address).__name__}")
        self.scheduler_address = address
        if self.security is None and self.cluster is not None:
            self.security = getattr(self.cluster, "security", None)
        comm = await connect(address, timeout=self.timeout, deserialize=False, security=self.security,
                             expect="scheduler")
        if self.security is None:
            self.security = comm.security  # what was found for the scheduler's address
        await comm.write({"op": "register-client", "client": self.id})
        reply = await comm.read()
        if not isinstance(reply, dict) or reply.get("status") != "OK":
            comm.abort()
            raise RuntimeError(f"the scheduler refused this client: {reply!r:.200}")
        link = reply.get("dashboard")
        self._dashboard_link = link if isinstance(link, str) else None
        self._comm = comm
        # values in shared memory: mapped when this process shares the domain (tried, not assumed)
        self._use_shm = shm.enabled()
        # a scheduler in another process of this host keeps the tasks' payloads: their
        # large arguments are handed over to it in shared memory (it forwards them)
        self._hand_over = comm.destination == SAME_HOST
        self._pickles_tasks = comm.destination != SAME_PROCESS or bool(getattr(self.cluster, "processes", True))
        self._stream = BatchedSend(name=f"{self.id}-to-scheduler", on_unsendable=self._unsendable)
        self._stream.start(comm)
        self._pool = ConnectionPool(deserialize=True, timeout=self.timeout, security=self.security)
        self._reader = asyncio.ensure_future(self._read_scheduler(comm))
        if config.get("heartbeat-interval") > 0:
            self._heartbeats = asyncio.ensure_future(send_heartbeats(self._stream, config.get("heartbeat-interval")))
        if comm.destination == SAME_PROCESS and self.cluster is None:
            # a scheduler of this process reached by its address (a task's client in an
            # in-process cluster): tasks are pickled only if a worker is elsewhere (one
            # that joins later and cannot take them fails them on the way, as any hop)
            info = await self._scheduler_rpc().scheduler_info()
            self._pickles_tasks = any(not str(w).startswith("inproc://") for w in info.get("workers") or ())
        self.status = "running"
        if self._dask_methods is None:
            # dask lowers a collection before any scheduler sees it, also one it is to
            # run with this client as ``scheduler=``: from now on until this client
            # closes (or is collected), dask picks shuffles right on any cluster
            self._dask_methods = dask_methods.hold_while(self)
        if self.set_as_default:
            set_default(self)
        return self

    def __await__(self) -> Any:
        return self._start().__await__()

    async def __aenter__(self) -> Client:
        return await self._start()

    async def __aexit__(self, *exc: Any) -> None:
        await self._close()

    def __enter__(self) -> Client:
        if self.asynchronous:
            raise TypeError("use 'async with' for an asynchronous client")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self, timeout: float | None = None) -> Any:
        """Close the connection (and the cluster this client started). Pending futures
        become cancelled; nothing hangs."""
        if self.asynchronous:
            return self._close()
        if self._loop_thread is None:
            return None
        try:
            self._stop_loop(self._close(), timeout=timeout or self.timeout + 30)
        finally:
            if self._callbacks is not None:
                self._callbacks.shutdown(wait=False)
        return None

    def _stop_loop(self, closing: Any, timeout: float | None = None) -> None:
        """Run ``closing`` (the _close() coroutine) on this client's loop, then stop the
        loop if this client owns it. A shared loop whose cluster closed first is gone:
        the client then just marks its futures cancelled."""
        thread, self._loop_thread = self._loop_thread, None
        assert thread is not None
        try:
            if thread.loop.is_closed():
                closing.close()
                unset_default(self)
                self._let_go_of_dask()
                self._mark_closed()
                self.status = "closed"
            else:
                thread.run(closing, timeout=timeout)
        finally:
            if self._own_loop:
                thread.stop()

    async def _close(self) -> None:
        if self.status in ("closing", "closed"):
            return
        self.status = "closing"
        unset_default(self)
        self._let_go_of_dask()
        if self._heartbeats is not None:
            self._heartbeats.cancel()
        self._flush_outbox()
        if self._stream is not None:
            try:
                self._stream.send({"op": "close-client"})
            except CommError:
                pass
            await self._stream.close(timeout=2.0)
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        if self._pool is not None:
            await self._pool.close()
        if self._hand_over:
            # segments the scheduler gave back for reuse: nothing will reuse them now
            shm_handover.reclaim_returned()
            shm.drain_pool()
        self._mark_closed()
        if self._own_cluster and self.cluster is not None:
            await self.cluster._close()
        self.status = "closed"

    def _let_go_of_dask(self) -> None:
        """This client no longer holds dask's methods (:mod:`.dask_methods`)."""
        if self._dask_methods is not None:
            self._dask_methods()  # (once: later calls do nothing)
            self._dask_methods = None

    def _mark_closed(self) -> None:
        for st in list(self._states.values()):
            if st.status not in ("finished", "error", "cancelled"):
                st.cancel("the client was closed")

    def __del__(self) -> None:
        if getattr(self, "status", "closed") == "running" and not self.asynchronous:
            try:
                self.close(timeout=5)
            except Exception:
                pass

    def __repr__(self) -> str:
        return f"<Client {self.id} scheduler={self.scheduler_address!r} {self.status}>"

    @property
    def dashboard_link(self) -> str | None:
        """The URL of the cluster's dashboard (its status page) with the token that logs
        its opener in (``?token=``, derived from this client's secret), or None without
        a dashboard."""
        link = getattr(self.cluster, "dashboard_link", None) if self.cluster is not None else None
        link = link if isinstance(link, str) else self._dashboard_link
        if link is None or "token=" in link:
            return link
        secret = getattr(self.security, "secret", None)
        if secret is None and self.scheduler_address:
            # a client of a scheduler of this process (inproc://) proved nothing: the
            # scheduler's own secret is known here
            try:
                secret = getattr(security_for(self.scheduler_address), "secret", None)
            except (OSError, ValueError):
                secret = None
        if not isinstance(secret, bytes):
            return link
        return f"{link}{'&' if '?' in link else '?'}token={dashboard_token(secret)}"

    # -- sync/async plumbing

    def _sync(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` (a coroutine function) the way this client runs:
        return the awaitable when asynchronous, else run it on the loop and wait."""
        if self.asynchronous:
            return fn(*args, **kwargs)
        if self._loop_thread is None:
            raise RuntimeError("this client is closed")
        with waiting():  # a task that waits on the cluster gives its thread up meanwhile
            return self._loop_thread.run(fn(*args, **kwargs))

    def _call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        loop = self.loop
        if loop is None:
            return
        if self._loop_thread is not None:
            self._loop_thread.call_soon(fn, *args)
        else:
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                fn(*args)
            elif not loop.is_closed():
                loop.call_soon_threadsafe(fn, *args)

    def _run_callback(self, fn: Callable[[Future], Any], future: Future) -> None:
        if self.asynchronous:
            try:
                fn(future)
            except Exception:
                logger.exception("a future's done callback failed")
            return
        if self._callbacks is None:
            self._callbacks = ThreadPoolExecutor(1, thread_name_prefix="shoal-callbacks")

        def call() -> None:
            try:
                fn(future)
            except Exception:
                logger.exception("a future's done callback failed")

        try:
            self._callbacks.submit(call)
        except RuntimeError:
            pass  # shut down

    # -- futures bookkeeping

    def _state_for(self, key: Any) -> FutureState:
        with self._lock:
            st = self._states.get(key)
            if st is None:
                st = self._states[key] = FutureState(key)
            return st

    def _future_for_key(self, key: Any) -> Future:
        """A future of ``key`` on this client: one it already holds, or one the
        scheduler is told this client wants (a future that came in a pickle)."""
        with self._lock:
            known = self._refcount.get(key, 0) > 0
        future = Future(key, self)
        if not known:
            self._enqueue({"op": "update-graph", "tasks": [], "wanted": [key]})
        return future

    def _inc_ref(self, key: Any) -> None:
        with self._lock:
            self._refcount[key] += 1

    def _dec_ref(self, key: Any) -> None:
        with self._lock:
            self._refcount[key] -= 1
            if self._refcount[key] > 0:
                return
            del self._refcount[key]
            self._states.pop(key, None)
        if self.status == "running":
            self._enqueue({"op": "release-keys", "keys": [key]}, lazy=True)

    def _enqueue(self, msg: dict[str, Any], lazy: bool = False) -> None:
        """Queue a message for the scheduler from any thread, keeping the order in
        which they were made; consecutive releases merge into one message. A lazy
        message (a release) wakes no one: it goes with the next message that must go,
        or after the ``batched-lazy-delay``."""
        with self._lock:
            last = self._outbox[-1] if self._outbox else None
            if last is not None and last["op"] == "release-keys" and msg["op"] == "release-keys":
                last["keys"].extend(msg["keys"])
            else:
                self._outbox.append(msg)
            flush = arm = False
            if not lazy and not self._flush_due:
                flush = self._flush_due = True
            elif lazy and not self._flush_due and not self._lazy_due:
                arm = self._lazy_due = True
        if flush:
            self._call_soon(self._flush_outbox)
        elif arm:
            self._call_soon(self._arm_lazy_flush)

    def _arm_lazy_flush(self) -> None:
        assert self.loop is not None
        self.loop.call_later(config.get("batched-lazy-delay"), self._lazy_flush)

    def _lazy_flush(self) -> None:
        with self._lock:
            self._lazy_due = False
        self._flush_outbox()

    def _flush_outbox(self) -> None:
        with self._lock:
            msgs, self._outbox = self._outbox, []
            self._flush_due = False
        if msgs:
            self._send(*msgs)

    def _send(self, *msgs: dict[str, Any]) -> None:
        if self._stream is None:
            return
        try:
            batch: list[dict[str, Any]] = []
            for msg in msgs:
                if msg["op"] == "update-graph" and len(msg["tasks"]) >= graphs.GRAPH_CHUNK:
                    # a part of a big graph goes in a write of its own: the scheduler
                    # starts on it while the next is serialized and sent
                    if batch:
                        self._stream.send(*batch)
                        batch = []
                    self._stream.send(msg, alone=True)
                else:
                    batch.append(msg)
            if batch:
                self._stream.send(*batch)
        except CommError:
            pass

    async def _read_scheduler(self, comm: Comm) -> None:
        try:
            while True:
                for msg in await read_batch(comm):
                    # checked completely: a scheduler that sends what is not a report
                    # is cut off (below), rather than leave a future waiting
                    decode(SCHEDULER_TO_CLIENT, msg, "the scheduler: ")
                    try:
                        self._handle_report(msg)
                    except Exception:
                        logger.exception("could not handle %r", msg)
        except (CommError, ProtocolError) as exc:
            if isinstance(exc, ProtocolError):
                logger.error("%s; closing the connection", exc)
                comm.abort()
            if self.status == "running":
                logger.warning("lost the connection to the scheduler at %s", self.scheduler_address)
                self.status = "disconnected"  # later submissions fail at once
                for st in list(self._states.values()):
                    if st.status not in ("finished", "error", "cancelled"):
                        st.cancel("the connection to the scheduler was lost")

    def _handle_report(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        st = self._states.get(msg.get("key"))
        if st is None:
            return
        if op == "key-in-memory":
            nbytes = msg.get("nbytes")
            st.finish(msg.get("workers") or [], msg.get("shm"), msg.get("value"), "value" in msg,
                      nbytes if type(nbytes) is int else 0)
        elif op == "task-erred":
            st.set_error(rebuild_exception(msg), msg.get("traceback") if isinstance(msg.get("traceback"), str) else None)
        elif op == "cancelled-key":
            st.cancel()
        elif op == "lost-key":
            st.lost()

    def _scheduler_rpc(self) -> PooledRPC:
        assert self._pool is not None
        return PooledRPC(self._pool, self.scheduler_address)

    def cancel(self, futures: Any) -> Any:
        """Cancel these futures' tasks (and this client's tasks that depend on them)."""
        flat: list[Future] = []
        collect_futures(futures, flat)
        return self._sync(self._cancel, flat)

    async def _cancel(self, futures: list[Future]) -> None:
        keys = [f.key for f in futures]
        for f in futures:
            if not f.done():
                f._state.cancel()
        self._enqueue({"op": "cancel-keys", "keys": keys})

    # -- cluster inspection and control

    def run(self, fn: Callable[..., Any], *args: Any, workers: Any = None, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on every worker (not as a task); returns
        ``{worker_address: result}``."""
        if not callable(fn):
            raise TypeError(f"run() needs a callable, got {type(fn).__name__}")
        return self._sync(self._run, fn, args, kwargs, workers)

    async def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], workers: Any) -> dict[str, Any]:
        info = await self._scheduler_rpc().scheduler_info()
        targets = worker_restrictions(workers) or serving(info, "run")
        assert self._pool is not None
        results = await asyncio.gather(*(
            PooledRPC(self._pool, w).run(function=to_serialize(fn), args=to_serialize(args), kwargs=to_serialize(kwargs))
            for w in targets
        ))
        return {w: _unwrap(r) for w, r in zip(targets, results)}

    def transfer_stats(self) -> Any:
        """Bytes of values each worker served to peers and clients or received by
        scatter, by how they travelled: ``{worker: {"inproc": n, "shm": n, "tcp": n}}``."""
        return self._sync(self._transfer_stats)

    async def _transfer_stats(self) -> dict[str, dict[str, int]]:
        info = await self._scheduler_rpc().scheduler_info()
        assert self._pool is not None
        workers = serving(info, "transfer-stats")
        stats = await asyncio.gather(*(PooledRPC(self._pool, w).transfer_stats() for w in workers))
        return dict(zip(workers, stats))

    def who_has(self, futures: Any = None) -> Any:
        """``{key: [worker_address, ...]}`` for these futures (or every key)."""
        keys = None
        if futures is not None:
            flat: list[Future] = []
            collect_futures(futures, flat)
            keys = [f.key for f in flat]
        return self._sync(self._who_has, keys)

    async def _who_has(self, keys: list[Any] | None) -> dict[Any, list[str]]:
        return await self._scheduler_rpc().who_has(keys=keys)

    def scheduler_counters(self) -> Any:
        """Scheduler-side counters (e.g. ``payload_deserializations``, always 0)."""
        return self._sync(self._counters)

    async def _counters(self) -> dict[str, Any]:
        return await self._scheduler_rpc().counters()
