"""What a state machine did, kept bounded, so that a bug can be told and replayed.

Both state machines (:class:`~shoal.scheduler.state.SchedulerState` and
:class:`~shoal.worker.state.WorkerState`) keep a :class:`StateLog`:

- the **events** they handled, in order, as the events themselves (what each carried,
  less the opaque user data: an event type may define ``logged()`` returning a copy
  without it, see :data:`DROPPED`), grouped by the ``handle()`` call that took them
  (:meth:`StateLog.calls`), so that feeding them to a fresh machine, call by call,
  replays the run and gives the same instructions;
- every **transition** of a key, ``(key, start, finish, stimulus_id)``, so that
  :meth:`StateLog.story` tells what happened to a key and which stimulus did it.

Both are bounded (oldest first out): the log costs a deque append per event and per
transition, and no more memory than its bounds (which count the tasks of logged
graphs too).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Hashable, Iterable, Reversible
from typing import Any, NamedTuple

from .errors import describe

__all__ = ["StateLog", "Transition", "DROPPED", "InvalidTransition", "internal_error", "internal_errors", "keys_of",
           "transitions_since"]

logger = logging.getLogger("shoal.statelog")

#: internal errors this process met (the last 100): an exception raised inside a state
#: machine's ``handle()``, which is a bug of shoal's, never bad input (input is checked
#: where it is decoded). The test suite fails a test that leaves one here.
internal_errors: deque[str] = deque(maxlen=100)


class InvalidTransition(RuntimeError):
    """A state machine was asked for a change of state its table does not allow; the
    state is left as it was."""


def keys_of(*events: Any) -> list[Hashable]:
    """The keys ``events`` are about, in order, once each (for their stories, or to
    fail them): the fields both machines' events name them by (``key``, ``keys``,
    ``wanted``, ``requested``, the keys of ``who_has`` and ``data``, the keys of a
    graph's ``tasks``)."""
    keys: list[Hashable] = []
    for ev in events:
        key = getattr(ev, "key", None)
        if key is not None:
            keys.append(key)
        for name in ("keys", "wanted", "requested", "who_has", "data"):
            keys.extend(getattr(ev, name, None) or ())
        keys.extend(t.key for t in getattr(ev, "tasks", None) or ())
    return list(dict.fromkeys(keys))


def internal_error(machine: str, exc: BaseException, log: StateLog, keys: Iterable[Hashable]) -> str:
    """Report an exception raised inside ``machine``'s ``handle()``: logged loudly
    with the stories of ``keys`` (the keys of the stimulus), and kept in
    :data:`internal_errors`. Returns the text. What to do next (close a worker, fail
    the stimulus's keys) is the caller's decision."""
    text = f"internal error in the {machine}'s state machine: {describe(exc)}\n{log.tell(keys)}"
    logger.critical("%s", text, exc_info=exc)
    internal_errors.append(text)
    return text


def transitions_since(transitions: Reversible[Any], last: Any) -> list[tuple[Any, str, str, str]]:
    """The transitions logged after ``last`` (the newest entry of ``transitions``, a
    log's deque, before a ``handle()`` call; None: all of them), oldest first: what
    that call did, for plugins to be told."""
    new = []
    for entry in reversed(transitions):
        if entry is last:
            break
        new.append(entry)
    new.reverse()
    return new


class _Dropped:
    """Stands for opaque user data (a task's payload, a value, an exception) that a
    logged event no longer holds: the log must not keep values (and their shared
    memory) alive. A replay carries it where the payload was."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "DROPPED"

    def __reduce__(self) -> str:
        return "DROPPED"


#: the marker of user data left out of the log
DROPPED: Any = _Dropped()


class Transition(NamedTuple):
    key: Hashable
    start: str
    finish: str
    stimulus_id: str


#: per event type: (its ``logged`` function or None, whether it carries ``tasks``)
_PLANS: dict[type, tuple[Any, bool]] = {}


def _plan(typ: type) -> tuple[Any, bool]:
    logged = getattr(typ, "logged", None)
    fields: Iterable[str] = (getattr(typ, "__dataclass_fields__", None) or getattr(typ, "__struct_fields__", None)
                             or ())
    plan = _PLANS[typ] = (logged if callable(logged) else None, "tasks" in fields or hasattr(typ, "tasks"))
    return plan


class StateLog:
    """The last ``events`` events and the last ``transitions`` transitions; the
    events kept hold at most ``tasks`` tasks of graphs in all (older events go first to
    make room: a graph's copy costs ~110 bytes per task)."""

    __slots__ = ("events", "transitions", "_starts", "tasks", "_tasks_held")

    def __init__(self, events: int = 10_000, transitions: int = 100_000, tasks: int = 10_000):
        self.events: deque[Any] = deque(maxlen=events)
        #: ``(key, start, finish, stimulus_id)`` tuples (plain: this is on the hot
        #: path; :meth:`story` gives :class:`Transition`\ s)
        self.transitions: deque[tuple[Hashable, str, str, str]] = deque(maxlen=transitions)
        #: per logged event, whether it began a ``handle()`` call (a machine may decide
        #: at the end of a call, over all its events: a replay makes the same calls)
        self._starts: deque[bool] = deque(maxlen=events)
        self.tasks = tasks
        #: the tasks of the graphs in ``events``
        self._tasks_held = 0

    def event(self, ev: Any, first: bool = True) -> None:
        """Keep ``ev`` (its ``logged()`` copy when it has one); ``first``: it is the
        first event of its ``handle()`` call."""
        plan = _PLANS.get(type(ev))
        if plan is None:
            plan = _plan(type(ev))
        logged, counts_tasks = plan
        if logged is not None:
            ev = logged(ev)
        events = self.events
        tasks = ev.tasks if counts_tasks else None
        if tasks or self._tasks_held:
            n = len(tasks) if tasks else 0
            while events and self._tasks_held + n > self.tasks:
                self._drop_oldest()
            if len(events) == events.maxlen:
                self._drop_oldest()  # (the deque would drop it unseen)
            self._tasks_held += n
        events.append(ev)
        self._starts.append(first)

    def _drop_oldest(self) -> None:
        old = self.events.popleft()
        self._starts.popleft()
        tasks = getattr(old, "tasks", None)
        if tasks:
            self._tasks_held -= len(tasks)

    def calls(self) -> list[list[Any]]:
        """The logged events grouped as they were handled, one list per ``handle()``
        call (the oldest may have lost its first events to the bound): what a replay
        feeds a fresh machine, call by call."""
        groups: list[list[Any]] = []
        for ev, first in zip(self.events, self._starts):
            if first or not groups:
                groups.append([])
            groups[-1].append(ev)
        return groups

    def transition(self, key: Hashable, start: str, finish: str, stimulus_id: str) -> None:
        self.transitions.append((key, start, finish, stimulus_id))

    def story(self, *keys: Hashable) -> list[Transition]:
        """The transitions of ``keys`` still in the log, oldest first."""
        wanted = set(keys)
        return [Transition(*t) for t in self.transitions if t[0] in wanted]

    def stimuli(self, *stimulus_ids: str) -> list[Any]:
        """The logged events with these stimulus ids, oldest first."""
        wanted = set(stimulus_ids)
        return [ev for ev in self.events if getattr(ev, "stimulus_id", None) in wanted]

    def tell(self, keys: Iterable[Hashable], limit: int = 50) -> str:
        """The stories of ``keys`` as text for a log line (the last ``limit`` steps)."""
        steps = self.story(*keys)[-limit:]
        return "\n".join(f"  {t.key!r:.80}: {t.start} -> {t.finish}  ({t.stimulus_id})" for t in steps) or "  (nothing logged)"
