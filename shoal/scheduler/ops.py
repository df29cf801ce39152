"""The scheduler's side of the client's cluster operations (:mod:`shoal.client.cluster_ops`):
``wait_for_workers``, ``has_what``, ``processing``, ``get_versions``, the plans of
``rebalance`` and the dropping of copies it (and ``replicate``) asks for, the
cancelling half of ``restart`` and the restart of workers through their nannies,
``upload_file``, and the plan of adaptive scaling for a cluster whose scheduler runs
in another process.

Nothing here deserializes anything: copies of values are made by the client (it fetches
them and places them with ``update-data``); the scheduler only plans moves and, through
its state machine (:class:`~.events.RemoveReplicasEvent`), drops copies, never the last
one. Uploaded files are bytes the scheduler keeps as they came and passes on to every
worker, and to each worker that joins later before it is given any task.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..comm import Comm, connect
from ..errors import CommError
from ..protocol.messages import Key
from ..protocol.versions import get_versions
from ..rpc import error_message, request
from .adaptive import plan
from .events import CancelKeysEvent, ReleaseKeysEvent, RemoveReplicasEvent

if TYPE_CHECKING:
    from .server import Scheduler

__all__ = ["SchedulerOps", "rebalance_moves", "MAX_UPLOADS", "MAX_UPLOAD_BYTES"]

logger = logging.getLogger("shoal.scheduler")

#: uploaded files kept for workers that join later, at most (by count and in all)
MAX_UPLOADS = 64
MAX_UPLOAD_BYTES = 256 * 2**20
#: rebalancing stops once the fullest and the emptiest worker are this close (a fraction
#: of the mean bytes per worker)
REBALANCE_TOLERANCE = 0.1


class SchedulerOps:
    """The rpc handlers of the client's cluster operations, for ``scheduler``."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        #: files uploaded so far, by name: (bytes, import them)
        self.uploads: dict[str, tuple[bytes, bool]] = {}

    def handlers(self) -> dict[str, Callable[..., Any]]:
        """The rpc handlers, by op."""
        return {
            "wait-for-workers": self.wait_for_workers,
            "has-what": self.has_what,
            "processing": self.processing,
            "versions": self.versions,
            "rebalance-plan": self.rebalance_plan,
            "remove-replicas": self.remove_replicas,
            "restart": self.restart,
            "restart-workers": self.restart_workers,
            "upload-file": self.upload_file,
            "adaptive-plan": self.adaptive_plan,
        }

    # -- what is where

    async def wait_for_workers(self, comm: Comm | None, n_workers: int, timeout: float | None = None) -> None:
        """Return once ``n_workers`` workers are registered. Raises ``ValueError`` for
        fewer than one worker or a negative timeout, ``TimeoutError`` after ``timeout``
        seconds."""
        if n_workers < 1:
            raise ValueError(f"n_workers must be a positive integer, got {n_workers}")
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout}")
        await self.scheduler.wait_for_workers(n_workers, None if timeout is None or math.isinf(timeout) else timeout)

    def has_what(self, comm: Comm | None, workers: list[str] | None = None) -> dict[str, list[Key]]:
        """``{worker: [key, ...]}``: the values each worker holds (an unknown worker: none)."""
        state = self.scheduler.state
        names = list(state.workers) if workers is None else workers
        return {w: [ts.key for ts in sorted(state.workers[w].has_what)] if w in state.workers else []
                for w in names}

    def processing(self, comm: Comm | None, workers: list[str] | None = None) -> dict[str, list[Key]]:
        """``{worker: [key, ...]}``: the tasks each worker was given to compute."""
        state = self.scheduler.state
        names = list(state.workers) if workers is None else workers
        return {w: [ts.key for ts in sorted(state.workers[w].processing)] if w in state.workers else []
                for w in names}

    def versions(self, comm: Comm | None, packages: list[str] | None = None) -> dict[str, Any]:
        """This process's versions (:func:`~shoal.protocol.versions.get_versions`)."""
        return get_versions(packages or ())

    def adaptive_plan(self, comm: Comm | None, workers: dict[str, str], threads_per_worker: int = 1,
                      target_duration: float = 5.0) -> dict[str, Any]:
        """``{"desired": int, "retirable": [name]}``: :func:`~.adaptive.plan` for a
        cluster whose adaptive scaling runs in another process (an SSHCluster's).
        Raises ``ValueError`` for fewer than one thread or a duration not > 0."""
        if threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {threads_per_worker}")
        if not (target_duration > 0 and math.isfinite(target_duration)):
            raise ValueError(f"target_duration must be a positive number of seconds, got {target_duration}")
        desired, names = plan(self.scheduler.state, workers, threads_per_worker, target_duration)
        return {"desired": desired, "retirable": names}

    # -- copies of values

    def rebalance_plan(self, comm: Comm | None, keys: list[Key] | None = None,
                       workers: list[str] | None = None) -> list[list[Any]]:
        """``[[key, sender, recipient], ...]``: moves that bring the bytes each of
        ``workers`` (default: all) holds close to their mean, moving only ``keys``
        (default: any value in memory). Raises ``ValueError`` for an unknown worker."""
        state = self.scheduler.state
        if workers is None:
            chosen = list(state.workers.values())
        else:
            unknown = [w for w in workers if w not in state.workers]
            if unknown:
                raise ValueError(f"no such worker(s) in this cluster: {unknown}")
            chosen = [state.workers[w] for w in dict.fromkeys(workers)]
        movable = None if keys is None else set(keys)
        loads = {ws.address: ws.nbytes for ws in chosen}
        holdings: dict[str, dict[Key, int]] = {}
        holders: dict[Key, set[str]] = {}
        for ws in chosen:
            mine = holdings[ws.address] = {}
            for ts in sorted(ws.has_what):
                if ts.state == "memory" and ts.nbytes > 0 and (movable is None or ts.key in movable):
                    mine[ts.key] = ts.nbytes
                    holders[ts.key] = {w.address for w in ts.who_has}
        return [[key, sender, recipient] for key, sender, recipient in rebalance_moves(loads, holdings, holders)]

    def remove_replicas(self, comm: Comm | None, who_has: dict[Key, list[str]] | None = None) -> None:
        """Drop these copies (each only while another worker holds the key)."""
        sched = self.scheduler
        sched._apply(RemoveReplicasEvent(sched._stimulus("remove-replicas"), who_has or {}))

    # -- restart

    def restart(self, comm: Comm | None, client: str = "") -> None:
        """Cancel every task of every client: the others' futures are told
        (``cancelled-key``); ``client``, the caller, cancels its own and is told nothing
        (a late notice could cancel a future it makes again right after)."""
        sched = self.scheduler
        wanted: dict[str, list[Key]] = {}
        for ts in sched.state.tasks.values():
            for who in ts.who_wants:
                wanted.setdefault(who, []).append(ts.key)
        stimulus = sched._stimulus("restart")
        for who in sorted(wanted):
            if who == client:
                sched._apply(ReleaseKeysEvent(stimulus, who, wanted[who]))
            else:
                sched._apply(CancelKeysEvent(stimulus, who, wanted[who]))
        logger.info("restart: cancelled the tasks of %d client(s)", len(wanted))

    async def restart_workers(self, comm: Comm | None, timeout: float | None = None) -> dict[str, Any]:
        """Have the nanny of each worker that has one restart it (``nanny-restart``),
        and wait until every new worker process has registered, ``timeout`` seconds at
        most in all (None: no limit). Returns ``{"restarted": n, "without_nanny":
        [address], "errors": {nanny address: message}}`` (nannies that failed, or whose
        worker did not join in time). Raises ``ValueError`` for a negative timeout."""
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout}")
        sched = self.scheduler
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None or math.isinf(timeout) else loop.time() + timeout
        workers = list(sched.state.workers.values())
        nannies = sorted({ws.nanny for ws in workers if ws.nanny})
        without = sorted(ws.address for ws in workers if not ws.nanny)
        replies = await asyncio.gather(*(self._restart_one(n, deadline) for n in nannies))
        errors = {n: r for n, r in zip(nannies, replies) if isinstance(r, str)}
        pids = {n: r for n, r in zip(nannies, replies) if isinstance(r, int)}

        def back() -> bool:  # each nanny's new process has joined
            joined = {(ws.nanny, ws.pid) for ws in sched.state.workers.values()}
            return all((n, pid) in joined for n, pid in pids.items())

        try:
            await asyncio.wait_for(self._workers_until(back), None if deadline is None else deadline - loop.time())
        except asyncio.TimeoutError:
            joined = {(ws.nanny, ws.pid) for ws in sched.state.workers.values()}
            for n, pid in pids.items():
                if (n, pid) not in joined:
                    errors[n] = f"its new worker did not join within {timeout}s"
        logger.info("restart-workers: %d restarted through their nannies, %d without one, %d failed",
                    len(pids), len(without), len(errors))
        return {"restarted": len(pids) - sum(1 for n in errors if n in pids), "without_nanny": without,
                "errors": errors}

    async def _workers_until(self, condition: Callable[[], bool]) -> None:
        """Return once ``condition()`` holds, looked at each time a worker joins or leaves."""
        sched = self.scheduler
        while not condition():
            # one event for every waiter: the first to see it set makes the next
            if sched._workers_changed is None or sched._workers_changed.is_set():
                sched._workers_changed = asyncio.Event()
            await sched._workers_changed.wait()

    async def _restart_one(self, nanny: str, deadline: float | None) -> int | str:
        """``nanny-restart`` to ``nanny``: the new worker's pid, or what went wrong."""
        loop = asyncio.get_running_loop()
        left = None if deadline is None else max(deadline - loop.time(), 0.0)
        try:
            comm = await connect(nanny, deserialize=False, security=self.scheduler.security, role="scheduler",
                                 expect="nanny", **({} if left is None else {"timeout": max(left, 0.1)}))
        except (CommError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}"
        try:
            response = await asyncio.wait_for(request(comm, "nanny-restart"), left)
        except (CommError, OSError, asyncio.TimeoutError) as exc:
            return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        finally:
            comm.abort()
        result = response.get("result")
        if response.get("status") != "OK" or not isinstance(result, dict) or not isinstance(result.get("pid"), int):
            return f"{response.get('type')}: {response.get('message')}"
        return int(result["pid"])

    # -- uploaded files

    async def upload_file(self, comm: Comm | None, filename: str, data: bytes,
                          load: bool = True) -> dict[str, Any]:
        """Keep the file for workers that join later and send it to every worker now;
        returns ``{worker: None, or the error response of a worker that failed}``.
        Raises ``ValueError`` for a name that is not a ``.py``/``.zip``/``.egg`` file
        name, or beyond :data:`MAX_UPLOADS` files or :data:`MAX_UPLOAD_BYTES`."""
        name = filename
        if (any(c in name for c in "/\\\x00") or name.startswith(".")
                or os.path.splitext(name)[1] not in (".py", ".zip", ".egg")):
            raise ValueError(f"upload_file() takes the name of a .py, .zip or .egg file, got {filename!r}")
        kept = {n: v for n, v in self.uploads.items() if n != name}
        if len(kept) >= MAX_UPLOADS or sum(len(d) for d, _ in kept.values()) + len(data) > MAX_UPLOAD_BYTES:
            raise ValueError(f"the scheduler keeps at most {MAX_UPLOADS} uploaded files of "
                             f"{MAX_UPLOAD_BYTES // 2**20} MiB in all")
        data = bytes(data)
        # kept first: a worker that joins meanwhile gets it too (twice does no harm)
        self.uploads.pop(name, None)
        self.uploads[name] = (data, load)
        workers = sorted(self.scheduler.worker_streams)
        replies = await asyncio.gather(*(self._send_file(w, name, data, load) for w in workers))
        errors = dict(zip(workers, replies))
        if any(e is not None for e in errors.values()) and self.uploads.get(name) == (data, load):
            # a file that fails to import is not sent to workers that join later
            del self.uploads[name]
        return errors

    async def worker_joins(self, address: str) -> None:
        """Send the uploaded files to the worker at ``address``, which is joining (before
        it is given tasks, so that they can import them); failures are logged."""
        for name, (data, load) in list(self.uploads.items()):
            try:
                error = await self._send_file(address, name, data, load)
            except Exception as exc:  # noqa: BLE001 - the worker joins anyway
                error = error_message(exc, with_exception=False)
            if error is not None:
                logger.warning("worker %s could not take the uploaded file %s: %s: %s",
                               address, name, error.get("type"), error.get("message"))

    async def _send_file(self, address: str, name: str, data: bytes, load: bool) -> dict[str, Any] | None:
        """``upload-file`` to one worker: None when it took the file, else the error
        response (its exception opaque, as the worker sent it)."""
        try:
            comm = await connect(address, deserialize=False, security=self.scheduler.security, role="scheduler",
                                 expect="worker")
        except (CommError, OSError) as exc:
            return error_message(exc, with_exception=False)
        try:
            response = await request(comm, "upload-file", filename=name, data=data, load=load)
        except (CommError, OSError) as exc:
            return error_message(exc, with_exception=False)
        finally:
            comm.abort()
        return None if response.get("status") == "OK" else response


def rebalance_moves(loads: dict[str, int], holdings: dict[str, dict[Key, int]],
                    holders: dict[Key, set[str]]) -> list[tuple[Key, str, str]]:
    """Moves ``(key, sender, recipient)`` that even out ``loads`` (bytes per worker):
    each time from the fullest worker to the emptiest, the key of the fullest (among
    ``holdings``: ``{worker: {key: nbytes}}`` that may move) whose size comes closest
    to half their difference, one the emptiest does not hold yet (``holders``: who
    holds each key). A key is moved only when it is smaller than the difference, so
    each move lowers the sum of the squared loads, and the planning ends: when the two
    are within :data:`REBALANCE_TOLERANCE` of the mean, or no key fits any pair. A key
    moved on again is one move from where it was to where it ends."""
    loads = dict(loads)
    if len(loads) < 2:
        return []
    holdings = {w: dict(keys) for w, keys in holdings.items()}
    holders = {k: set(ws) for k, ws in holders.items()}
    mean = sum(loads.values()) / len(loads)
    moved: dict[Key, tuple[str, str]] = {}  # key: (where it was, where it goes)
    stuck: set[tuple[str, str]] = set()
    while True:
        pair = _next_pair(loads, REBALANCE_TOLERANCE * mean, stuck)
        if pair is None:
            return [(k, origin, to) for k, (origin, to) in moved.items() if origin != to]
        sender, recipient = pair
        gap = loads[sender] - loads[recipient]
        fits = [(abs(gap / 2 - size), repr(k), k, size) for k, size in holdings.get(sender, {}).items()
                if size < gap and recipient not in holders.get(k, ())]
        if not fits:
            stuck.add((sender, recipient))
            continue
        _, _, key, size = min(fits, key=lambda f: (f[0], f[1]))
        del holdings[sender][key]
        holdings.setdefault(recipient, {})[key] = size
        holders[key] = (holders.get(key, set()) - {sender}) | {recipient}
        loads[sender] -= size
        loads[recipient] += size
        moved[key] = (moved[key][0] if key in moved else sender, recipient)
        stuck.clear()


def _next_pair(loads: dict[str, int], tolerance: float, stuck: set[tuple[str, str]]) -> tuple[str, str] | None:
    """The fullest sender and emptiest recipient further apart than ``tolerance`` that
    are not ``stuck`` (no key of one fits the other), or None."""
    fullest = sorted(loads, key=lambda w: (-loads[w], w))
    emptiest = fullest[::-1]
    for sender in fullest:
        for recipient in emptiest:
            if loads[sender] - loads[recipient] <= tolerance:
                break  # the others are closer still
            if (sender, recipient) not in stuck:
                return sender, recipient
    return None
