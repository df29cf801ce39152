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
from ..comm import Comm, connect, shm, shm_family, shm_handover
from ..comm.security import Security, dashboard_token
from ..comm.security import for_address as security_for
from ..errors import CommBrokenError, CommError, CorruptedDataError, LostDataError, ProtocolError
from ..protocol.messages import SCHEDULER_TO_CLIENT, decode
from ..protocol import SAME_HOST, SAME_PROCESS, to_serialize
from ..rpc import BatchedSend, ConnectionPool, PooledRPC, fetch_deadline, read_batch, send_heartbeats
from ..taskspec import RunSpec, tokenize, unique_token, validate_key
from .cluster_ops import ClusterOps
from .diagnostics import TaskStreamMethods
from .collections import DaskCollections
from . import graphs
from ..worker.context import waiting
from .default import set_default, unset_default
from .plugins import Plugins
from .worker_plugins import WorkerPluginMethods
from .submit import Submitting
from .coordination import PublishedDatasets
from .future import Future, FutureState, _unwrap, as_actor
from .options import worker_restrictions
from .structure import collect_futures, rebuild, rebuild_exception

#: the bytes a gather asks of one worker in one request, at most (one value may be more)
GATHER_BATCH_BYTES = 64 << 20

__all__ = ["Client"]

logger = logging.getLogger("shoal.client")

class Client(Submitting, DaskCollections, PublishedDatasets, Plugins, WorkerPluginMethods, ClusterOps,
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

    # -- results

    async def _wait_states(self, states: list[FutureState], timeout: float | None) -> None:
        """Return once every state is final (finished, erred, cancelled); raises
        ``TimeoutError`` after ``timeout`` seconds, values lost and recomputed meanwhile
        included."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        pending = states
        # a future may be lost (and recomputed) after it finished: wait again
        while pending := [st for st in pending if st.status not in ("finished", "error", "cancelled")]:
            # one waiter for all of them: states change on this loop and count down
            done = loop.create_future()
            remaining = [len(pending)]

            def one_done() -> None:
                remaining[0] -= 1
                if remaining[0] == 0 and not done.done():
                    done.set_result(None)

            for st in pending:
                st.on_done(one_done)
            try:
                await asyncio.wait_for(done, None if deadline is None else max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                left = sum(st.status not in ("finished", "error", "cancelled") for st in pending)
                raise TimeoutError(f"{left} future(s) not done within {timeout}s") from None

    def gather(self, futures: Any, errors: str = "raise") -> Any:
        """The values of ``futures`` (a future, or lists/tuples/dicts of them), in the
        same structure. Raises the first erred task's exception (``errors="raise"``);
        ``errors="skip"`` leaves erred results out of lists (None in their place
        elsewhere), as dask does."""
        return self._sync(self._gather_structure, futures, errors)

    async def _gather_structure(self, futures: Any, errors: str = "raise") -> Any:
        flat: list[Future] = []
        collect_futures(futures, flat)
        values = await self._gather_async(flat, errors=errors)
        by_key = {f.key: v for f, v in zip(flat, values)}
        skipped = frozenset(f.key for f in flat if f.status in ("error", "cancelled")) if errors == "skip" else frozenset()
        return rebuild(futures, by_key, skipped)

    async def _gather_async(self, futures: list[Future], timeout: float | None = None, errors: str = "raise") -> list[Any]:
        """The futures' values (waiting for them); raises the first erred task's
        exception (``errors="raise"``), ``TimeoutError`` after ``timeout`` seconds
        whatever the cluster does (a holder that never answers included), and
        :class:`~shoal.errors.LostDataError` for values no holder hands out."""
        if timeout is None:
            return await self._gather_values(futures, errors)
        # (values at hand, with no wait, are returned even with a timeout of 0)
        limit = asyncio.timeout(timeout)
        try:
            async with limit:
                return await self._gather_values(futures, errors)
        except TimeoutError:
            if not limit.expired():
                raise
            left = sum(f._state.status not in ("finished", "error", "cancelled") for f in futures)
            raise TimeoutError(f"{len(futures)} future(s) not gathered within {timeout}s ({left} not done)") from None

    async def _gather_values(self, futures: list[Future], errors: str) -> list[Any]:
        states = [f._state for f in futures]
        values: dict[Any, Any] = {}
        for attempt in range(20):
            await self._wait_states(states, None)
            for st in states:
                if st.status in ("error", "cancelled") and errors == "raise":
                    assert st.exception is not None
                    raise st.exception
            need = [st for st in states if st.status == "finished" and st.key not in values]
            for st in need:
                if st.has_value:  # a small result that came with its report
                    try:
                        values[st.key] = _unwrap(st.value)
                    except Exception:
                        st.has_value = False  # ask its worker instead
            need = [st for st in need if st.key not in values]
            if self._use_shm:
                # values in shared memory on this host: map them, no worker involved
                for st in need:
                    if st.shm is not None:
                        try:
                            values[st.key] = shm.attach(st.shm)
                        except Exception:  # gone, reused, corrupt: ask its worker instead
                            st.shm = None
                need = [st for st in need if st.key not in values]
            if need and self.status != "running":
                # workers leave with their scheduler: nobody is left to serve these
                raise LostDataError(f"{[st.key for st in need]!r:.200} cannot be fetched: the "
                                    f"connection to the scheduler at {self.scheduler_address} is gone")
            by_worker: dict[str, list[Any]] = {}
            unknown: list[Any] = []
            for st in need:
                if st.workers:
                    by_worker.setdefault(st.workers[0], []).append(st.key)
                else:
                    unknown.append(st.key)
            if unknown:
                who_has = await self._scheduler_rpc().who_has(keys=unknown)
                for k in unknown:
                    holders = who_has.get(k) or []
                    if holders:
                        by_worker.setdefault(holders[0], []).append(k)
            results = await asyncio.gather(
                *(self._get_data_batched(w, keys) for w, keys in by_worker.items()), return_exceptions=True
            )
            for (w, keys), res in zip(by_worker.items(), results):
                if isinstance(res, BaseException):
                    # (bytes that failed their checksum on the way: asked for again)
                    if not isinstance(res, (CommError, OSError, CorruptedDataError)):
                        raise res
                    res = {}
                values.update(res)
                for k in keys:
                    if k not in res:
                        state = self._states.get(k)
                        if state is not None and state.workers and state.workers[0] == w:
                            state.workers = state.workers[1:]  # w did not have it: try the next
            # a key lost since it finished (its holder could not read it back, or died)
            # is being computed again: waited for at the top of the next round
            missing = [st for st in states if st.status not in ("error", "cancelled") and st.key not in values]
            if not missing:
                break
            if need and not any(st.key in values for st in need):
                # nothing came: a holder lost the value and the scheduler's word of it
                # (lost-key) is on its way; a moment before asking again
                await asyncio.sleep(min(0.005 * 2**attempt, 0.5))
        else:
            raise LostDataError(f"could not fetch {[st.key for st in missing]!r} from any worker")
        out = []
        for st in states:
            if st.key in values:
                out.append(as_actor(values[st.key], self))
            elif errors == "skip":
                out.append(None)
            else:
                out.append(st.exception)
        return out

    async def _get_data_batched(self, worker: str, keys: list[Any]) -> dict[Any, Any]:
        """:meth:`_get_data` in requests of at most :data:`GATHER_BATCH_BYTES` each (by
        the sizes the workers reported), one after the other: a worker reads spilled
        values back from disk to send them, and must not hold them all at once."""
        batches: list[list[Any]] = [[]]
        size = 0
        for k in keys:
            st = self._states.get(k)
            n = st.nbytes if st is not None else 0
            if batches[-1] and size + n > GATHER_BATCH_BYTES:
                batches.append([])
                size = 0
            batches[-1].append(k)
            size += n
        if len(batches) == 1:
            return await self._get_data(worker, keys)
        out: dict[Any, Any] = {}
        for batch in batches:
            out.update(await self._get_data(worker, batch))
        return out

    async def _get_data(self, worker: str, keys: list[Any]) -> dict[Any, Any]:
        """The values ``worker`` holds of ``keys``. Raises
        :class:`~shoal.errors.CommBrokenError` when it has not answered within the
        fetch deadline (``fetch-timeout``), the errors of the connection, and the
        worker's error."""
        assert self._pool is not None
        nbytes = 0
        for k in keys:
            st = self._states.get(k)
            nbytes += st.nbytes if st is not None else 0
        deadline = fetch_deadline(nbytes)
        try:
            result = await asyncio.wait_for(PooledRPC(self._pool, worker).get_data(keys=keys), deadline)
        except asyncio.TimeoutError:
            raise CommBrokenError(f"{worker} did not answer get-data within {deadline:.1f}s (fetch-timeout)") from None
        return {k: _unwrap(v) for k, v in result["data"].items()}

    def _scheduler_rpc(self) -> PooledRPC:
        assert self._pool is not None
        return PooledRPC(self._pool, self.scheduler_address)

    # -- data placement

    def scatter(self, data: Any, workers: Any = None, broadcast: bool = False, direct: bool | None = None,
                hash: bool = True) -> Any:
        """Put ``data`` on workers: one object gives one future, a list a list, a dict
        a dict of futures keyed alike. ``workers`` limits where; ``broadcast`` puts
        every value on every (allowed) worker. Keys are tokens of the values, or random
        with ``hash=False``. ``direct`` is accepted for dask's sake: this client always
        sends values to the workers directly (the scheduler never holds them)."""
        return self._sync(self._scatter, data, workers, broadcast, hash)

    async def _scatter(self, data: Any, workers: Any = None, broadcast: bool = False, hash: bool = True) -> Any:
        def key_of(v: Any) -> str:
            return f"{type(v).__name__}-{tokenize(v) if hash else unique_token()}"

        if isinstance(data, dict):
            items = list(data.items())
            for k, _ in items:
                validate_key(k)
        elif isinstance(data, (list, tuple, set, frozenset)):
            items = [(key_of(v), v) for v in data]
        else:
            items = [(key_of(data), data)]
        info = await self._scheduler_rpc().scheduler_info()
        targets = serving(info, "update-data")
        allowed = worker_restrictions(workers)
        if allowed is not None:
            unknown = [w for w in allowed if w not in info["workers"]]
            if unknown:
                raise ValueError(f"no such worker(s) in this cluster: {unknown}")
            targets = [w for w in targets if w in allowed]
        if not targets:
            raise RuntimeError("the cluster has no workers to scatter to" + (
                "" if not info["workers"] else " (none of them serves update-data)"))
        placement: dict[str, dict[Any, Any]] = {}
        who_has: dict[Any, list[str]] = {}
        shared: list[Any] = []
        for k, v in items:
            chosen = targets if broadcast else [targets[next(self._scatter_rr) % len(targets)]]
            if len(chosen) > 1 and self._use_shm:
                v = self._one_copy(v, shared)
            for w in chosen:
                placement.setdefault(w, {})[k] = to_serialize(v)
            who_has[k] = chosen
        assert self._pool is not None
        try:
            replies = await asyncio.gather(*(PooledRPC(self._pool, w).update_data(data=d) for w, d in placement.items()))
        finally:
            # every worker has mapped what it maps: the name may go (the pages stay
            # theirs) and the memory waits in this process's pool for reuse
            for seg in shared:
                seg.retire()
        nbytes: dict[Any, int] = {}
        placed: dict[Any, Any] = {}  # values a worker keeps in shared memory, and where
        for reply in replies:
            nbytes.update(reply["nbytes"])
            placed.update(reply.get("shm") or {})
        futures = {k: Future(k, self) for k, _ in items}
        for k, f in futures.items():
            f._state.finish(who_has[k])
        extra = {"shm": placed} if placed else {}
        await self._scheduler_rpc().update_data(who_has=who_has, nbytes=nbytes, client=self.id, **extra)
        if isinstance(data, dict):
            return futures
        if isinstance(data, (list, tuple, set, frozenset)):
            return [futures[k] for k, _ in items]
        return futures[items[0][0]]

    @staticmethod
    def _one_copy(value: Any, shared: list[Any]) -> Any:
        """``value`` copied once into shared memory, for several workers of this host
        to map (instead of a copy each); the value itself if that is not worth it."""
        try:
            placed = shm.place(value, shm_family.TRANSFER_MIN_BYTES)
        except shm.ShmUnavailable:
            return value
        if placed is None:
            return value
        shared.append(placed[0])
        return placed[1]

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


def serving(info: dict[str, Any], op: str) -> list[str]:
    """The workers of ``scheduler_info()`` that serve the optional ``op`` (those that
    declared no ``ops`` serve them all), sorted: a worker in another language may not."""
    return sorted(a for a, w in info["workers"].items() if "ops" not in w or op in w["ops"])
