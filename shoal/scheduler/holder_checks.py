"""The scheduler's own questions to the holders of values (:class:`~.events.CheckHolder`).

Workers sent to fetch a value said its one holder took their request and did not serve
it. The state does not take their word for it: it asks the holder, and this module
carries the question out. It opens a connection of its own to the holder's listener,
the one the holder's peers fetch through, and sends ``has-keys`` (docs/protocol.md
§8.2); the holder's event loop answers from what its store holds, without reading the
value. The scheduler never sees the value itself: it would have to take in what may be
gigabytes to learn what the answer already says (the holder has it, and the loop that
serves it runs), and it decodes no user data.

The answer goes back to the state as a :class:`~.events.HolderCheckedEvent`: held, not
held, or None when none came within the deadline, when the holder could not be reached,
or when it does not serve the op (a worker whose registration lists the optional ops
it serves without ``has-keys``, or one that answers with an error). The deadline is
``worker-ttl``, the time the scheduler gives any worker to show it is alive
(``fetch-timeout`` when that rule is off; neither: none), so that a holder whose event
loop is held up by a long call is not removed for it sooner than for its silence.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import config
from ..comm import connect
from ..errors import CommError, describe
from ..protocol.messages import HasKeysMsg, Key, to_wire
from .events import CheckHolder, HolderCheckedEvent

if TYPE_CHECKING:
    from .server import Scheduler

__all__ = ["HolderChecks", "check_deadline", "HAS_KEYS"]

logger = logging.getLogger("shoal.scheduler")

#: the op of the question
HAS_KEYS: str = HasKeysMsg.__struct_config__.tag  # type: ignore[assignment]


def check_deadline() -> float | None:
    """Seconds a holder has to answer the scheduler's ``has-keys``: ``worker-ttl``, or
    ``fetch-timeout`` when that is 0; None (no deadline) when both are."""
    for name in ("worker-ttl", "fetch-timeout"):
        value = config.get(name)
        if value and value > 0:
            return float(value)
    return None


class HolderChecks:
    """The questions out to holders, for ``scheduler``: each is a task of its own,
    cancelled when its worker leaves (its answer would change nothing then) or the
    scheduler closes."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self._running: dict[str, set[asyncio.Future[None]]] = {}

    def start(self, inst: CheckHolder) -> None:
        """Ask ``inst.worker`` about ``inst.key``; the answer is applied to the state."""
        task = asyncio.ensure_future(self._check(inst))
        self._running.setdefault(inst.worker, set()).add(task)
        task.add_done_callback(self._finished(inst.worker))

    def _finished(self, worker: str) -> Callable[[asyncio.Future[None]], None]:
        def done(task: asyncio.Future[None]) -> None:
            running = self._running.get(worker)
            if running is not None:
                running.discard(task)
                if not running:
                    del self._running[worker]
            if not task.cancelled() and task.exception() is not None:
                logger.error("the check of holder %s failed", worker, exc_info=task.exception())

        return done

    def worker_left(self, worker: str) -> None:
        """``worker`` is gone: its questions are dropped."""
        for task in self._running.pop(worker, ()):
            task.cancel()

    def close(self) -> None:
        for worker in list(self._running):
            self.worker_left(worker)

    async def _check(self, inst: CheckHolder) -> None:
        held, why = await self.ask(inst.worker, inst.key)
        if held is None:
            logger.warning("worker %s, the one holder of %r that workers sent to fetch it say did not serve it: %s",
                           inst.worker, inst.key, why)
        sched = self.scheduler
        sched._apply(HolderCheckedEvent(sched._stimulus("holder-checked"), inst.worker, inst.key, held, why))

    async def ask(self, worker: str, key: Key) -> tuple[bool | None, str]:
        """Whether ``worker`` holds ``key`` and serves it, and if that could not be
        learned (None), why."""
        sched = self.scheduler
        ws = sched.state.workers.get(worker)
        if ws is not None and ws.ops is not None and HAS_KEYS not in ws.ops:
            return None, f"it does not serve {HAS_KEYS} (not among the optional ops it registered with)"
        deadline = check_deadline()
        try:
            return await asyncio.wait_for(self._ask(worker, key), deadline)
        except asyncio.TimeoutError:
            return None, f"it did not answer the scheduler's {HAS_KEYS} within {deadline:g}s"
        except (CommError, OSError) as exc:
            return None, f"the scheduler could not ask it ({describe(exc)})"

    async def _ask(self, worker: str, key: Key) -> tuple[bool | None, str]:
        sched = self.scheduler
        comm = await connect(worker, deserialize=False, security=sched.security, role="scheduler", expect="worker")
        try:
            await comm.write(to_wire(HasKeysMsg([key])))
            response: Any = await comm.read()
        finally:
            comm.abort()
        if not isinstance(response, dict) or response.get("status") != "OK":
            text = response.get("message") if isinstance(response, dict) else response
            return None, f"it answered {HAS_KEYS} with an error: {text!r:.200}"
        result = response.get("result")
        held = result.get("held") if isinstance(result, dict) else None
        if not isinstance(held, list):
            return None, f"it answered {HAS_KEYS} with {result!r:.200}"
        return key in held, ""
