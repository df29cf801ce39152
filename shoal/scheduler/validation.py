"""The scheduler state's invariants, checked by ``SchedulerState.validate()``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .model import FEW
from .placement import WAIT_OVERFILL

if TYPE_CHECKING:
    from .state import SchedulerState

__all__ = ["validate_state", "STATES"]

STATES = {"released", "waiting", "queued", "processing", "memory", "erred"}


def validate_state(state: SchedulerState) -> None:
    """Check every invariant; raise ``AssertionError`` on the first broken one."""
    _validate_groups(state)
    assert state.non_python_workers == sum("python" not in ws.languages for ws in state.workers.values())
    counts: dict[str, int] = {}
    for ts in state.queued:
        counts[ts.language] = counts.get(ts.language, 0) + 1
    assert state.queued_languages == counts, (state.queued_languages, counts)
    for key, ts in state.tasks.items():
        assert ts.key == key
        assert ts.state in STATES, ts
        if ts.state == "memory":
            assert ts.who_has, f"{ts} in memory on no worker"
            assert ts.who_wants or ts.waiters, f"{ts} in memory, but nobody needs it"
        else:
            assert not ts.who_has, f"{ts} not in memory but held by {ts.who_has}"
        if ts.once and ts.state in ("waiting", "queued"):
            assert not ts.sent, f"{ts} may run only once, and was sent to a worker before"
        if ts.state == "processing":
            assert ts.sent, ts
            ws = ts.processing_on
            assert ws is not None and ts in ws.processing, ts
            assert state.workers.get(ws.address) is ws, ts
            assert ts.loose_restrictions or state._allowed(ts, ws), ts
            assert ts.language in ws.languages, f"{ts} ({ts.language}) on {ws.address}, which runs {sorted(ws.languages)}"
        else:
            assert ts.processing_on is None, ts
        if ts.state == "queued":
            assert ts in state.queued
            assert all(d.state == "memory" for d in ts.dependencies), ts
        if ts.state == "waiting":
            assert ts.waiting_on, f"{ts} waits on nothing"
            assert set(ts.waiting_on) == {d for d in ts.dependencies if d.state != "memory"}, ts
            assert all(d.state in ("waiting", "queued", "processing") for d in ts.waiting_on), ts
        else:
            assert not ts.waiting_on, ts
        if ts.state in ("released", "erred"):
            assert ts.who_wants or ts.dependents, f"{ts} is needed by nobody: it should be forgotten"
        if ts.state == "released":
            assert not ts.waiters, ts
        # (a locate task in memory keeps its inputs: it waits on them until released)
        assert set(ts.waiters) == {d for d in ts.dependents if d.state in ("waiting", "queued", "processing")
                                   or (d.state == "memory" and d in state.locating)}, ts
        if ts.state == "erred":
            assert ts.exception_blame is not None, ts
        for dep in ts.dependencies:
            assert ts in dep.dependents
            assert state.tasks.get(dep.key) is dep, f"{ts} depends on forgotten {dep}"
        for dts in ts.dependents:
            assert ts in dts.dependencies
            assert state.tasks.get(dts.key) is dts, f"{ts} has forgotten dependent {dts}"
        for ws in ts.who_has:
            assert ts in ws.has_what and state.workers.get(ws.address) is ws
        # reports that the holder did not serve, and the question put to it, are
        # about a one holder (any change of holders ends them)
        if ts.unserved or ts.checking is not None:
            assert len(ts.who_has) == 1, (ts, ts.who_has, ts.unserved, ts.checking)
        if ts.checking is not None:
            assert next(iter(ts.who_has)).address == ts.checking, (ts, ts.checking)
        assert type(ts.unserved) is not tuple or len(set(ts.unserved)) == len(ts.unserved), ts
        for few in (ts.dependents, ts.waiting_on, ts.waiters, ts.who_has, ts.who_wants):
            if type(few) is tuple:
                assert len(few) <= FEW and len(set(few)) == len(few), (ts, few)
    # tasks given back while an input's holder is asked wait for the answer, no longer
    for ts, ws in state._parked.items():
        if ts.state == "processing" and ts.processing_on is ws:
            assert any(d.checking is not None for d in ts.dependencies), f"{ts} parked, with no question out"
    assert len(state.queued) == len(set(state.queued))
    for ts in state.queued:
        assert ts.state == "queued" and state.tasks.get(ts.key) is ts
        # no worker it may run on has room
        for ws in state.workers.values():
            if state._may_run(ts, ws):
                assert state._capacity(ws) <= 0, f"{ts} queued while {ws} has room"
    # each language's room index holds exactly its workers with room, at their current load
    assert state.rooms["python"] is state.room
    languages = {lang for ws in state.workers.values() for lang in ws.languages}
    assert languages <= state.rooms.keys(), (languages, sorted(state.rooms))
    for lang, room in state.rooms.items():
        with_room = {ws.address: len(ws.processing) / ws.nthreads for ws in state.workers.values()
                     if lang in ws.languages and state._capacity(ws) > 0}
        assert room.with_room() == with_room, (lang, room.with_room(), with_room)
        if with_room:
            best = room.best()
            assert best is not None and min((b, a) for a, b in with_room.items()) == (with_room[best.address],
                                                                                      best.address)
    # the indexes of workers by name and by resource
    named: dict[str, set[Any]] = {}
    offering: dict[str, set[Any]] = {}
    for ws in state.workers.values():
        for name in (ws.address, ws.name, ws.ip):
            if name:
                named.setdefault(name, set()).add(ws)
        for name, amount in ws.resources.items():
            if amount > 0:
                offering.setdefault(name, set()).add(ws)
    assert state.named == named, "the index of workers by name is off"
    assert state.offering == offering, "the index of workers by resource is off"
    assert offering.keys() <= state.resource_rooms.keys(), (sorted(offering), sorted(state.resource_rooms))
    for name, room in state.resource_rooms.items():
        with_room = {ws.address: len(ws.processing) / ws.nthreads for ws in offering.get(name, ())
                     if state._capacity(ws) > 0 and ws.resources[name] - ws.used_resources.get(name, 0) > 1e-9}
        assert room.with_room() == with_room, (name, room.with_room(), with_room)
    for ws in state.workers.values():
        # seceded (long-running) tasks hold no thread: the bound is on the others
        assert ws.long_running <= ws.processing, ws
        # (inputs' holders and siblings may fill a worker up to twice its room, and the
        # holder of a large input of cheap tasks up to WAIT_OVERFILL times it)
        limit = WAIT_OVERFILL * ws.nthreads * (1 + max(state.ahead, state.max_ahead))
        assert len(ws.processing) - len(ws.long_running) <= limit, ws
        for ts in ws.processing:
            assert ts.processing_on is ws and ts.state == "processing"
        for ts in ws.has_what:
            assert ws in ts.who_has
        assert ws.nbytes == sum(max(ts.nbytes, 0) for ts in ws.has_what), ws
        held: dict[str, float] = {}
        for ts in ws.processing:
            for name, amount in (ts.resources or {}).items():
                held[name] = held.get(name, 0) + amount
        assert held.keys() == ws.used_resources.keys(), ws
        for name, amount in held.items():
            assert abs(ws.used_resources[name] - amount) < 1e-6, ws
            assert amount <= ws.resources.get(name, 0) + 1e-6, f"{ws} holds more {name} than it has"
        # only a check finds a worker overdue, and only when the rule is on
        assert not ws.overdue or (state.worker_ttl > 0 and ws.last_seen is not None), ws


def _validate_groups(state: SchedulerState) -> None:
    """The prefix groups count the known tasks by state (the forgotten ones aside)."""
    counted: dict[str, dict[str, int]] = {}
    for ts in state.tasks.values():
        g = ts.group
        assert g is not None and state.groups.get(g.name) is g, f"{ts} is in no group of the state"
        counts = counted.setdefault(g.name, {})
        counts[ts.state] = counts.get(ts.state, 0) + 1
    for name, g in state.groups.items():
        live = {s: n for s, n in g.states.items() if n and s != "forgotten"}
        assert live == counted.get(name, {}), f"group {name}: counts {live} for tasks {counted.get(name, {})}"
        assert sum(g.states.values()) == g.size and g.states["forgotten"] < g.size, g
        assert 0 <= g.done <= g.size, g
