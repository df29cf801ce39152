"""The worker state's invariants, checked by ``WorkerState.validate()``."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .model import SHM, STATES

if TYPE_CHECKING:
    from .state import WorkerState

__all__ = ["validate_state"]


def validate_state(state: WorkerState) -> None:
    """Check every invariant; raise ``AssertionError`` on the first broken one."""
    for key, ts in state.tasks.items():
        assert ts.key == key
        assert ts.state in STATES, ts
        assert (ts.state == "memory") == (key in state.data), ts
        assert state.address not in ts.who_has, ts
        if ts.state == "waiting":
            assert ts.waiting_for_data, ts
            assert ts.waiting_for_data <= ts.dependencies, ts
            for dep in ts.waiting_for_data:
                assert dep.state in ("fetch", "flight", "waiting", "ready", "executing", "cancelled"), (ts, dep)
        else:
            assert not ts.waiting_for_data, ts
        if ts.state in ("waiting", "ready", "executing"):
            assert ts.origin == "compute", ts
        if ts.state == "ready":
            assert any(e[2] is ts for e in (state.constrained if ts.resources else state.ready)), ts
            assert all(d.state == "memory" for d in ts.dependencies), ts
        if ts.state in ("fetch", "flight"):
            assert ts.origin == "fetched" and not ts.dependencies, ts
            assert any(ts in d.waiting_for_data for d in ts.dependents), f"{ts} fetched for nobody"
        if ts.state == "fetch":
            assert ts in state.fetching and (ts.who_has or ts.shm is not None), ts
        if ts.state == "flight":
            assert ts.coming_from is not None and ts in state.in_flight_workers[ts.coming_from], ts
        else:
            assert ts.coming_from is None, ts
        if ts.state in ("executing", "cancelled"):
            assert ts in state.executing or ts in state.seceded, ts
        if ts.state == "cancelled":
            assert ts.origin == "fetched", ts
        elif ts.origin == "fetched":
            assert ts.dependents, f"{ts}: a fetched copy nobody needs"
        for dep in ts.dependencies:
            assert ts in dep.dependents, (ts, dep)
            assert state.tasks.get(dep.key) is dep, (ts, dep)
        for dts in ts.dependents:
            assert ts in dts.dependencies, (ts, dts)
            assert state.tasks.get(dts.key) is dts, (ts, dts)
            assert dts.state in ("waiting", "ready", "executing", "cancelled"), (ts, dts)
    assert set(state.data) <= set(state.tasks)
    _validate_threads(state)
    _validate_resources(state)
    for ts in state.fetching:
        assert ts.state == "fetch" and state.tasks.get(ts.key) is ts
    assert len(state.in_flight_workers) <= state.max_gathers
    for peer, flight in state.in_flight_workers.items():
        for ts in flight:
            assert ts.state == "flight" and ts.coming_from == peer and state.tasks.get(ts.key) is ts
    if len(state.in_flight_workers) < state.max_gathers and not state.paused:
        room = None if state.transfer_bytes is None else state.transfer_bytes - state.in_flight_bytes()
        for ts in state.fetching:
            if ts.shm is None and room is not None and (room <= 0 or ts.nbytes > room) and \
                    state.in_flight_workers.keys() - {SHM}:
                continue  # waits for room among the bytes in flight
            assert ts.who_has <= state.in_flight_workers.keys(), f"{ts} could be fetched now"


def _validate_threads(state: WorkerState) -> None:
    """Slots: at most ``slots`` tasks hold one; seceded tasks hold none; no slot is
    idle while a task could take it."""
    # beyond ``slots`` only tasks that overtook ones handed to the pool ahead: no
    # ready task is more urgent than every one handed to the pool
    slots = state.open_slots
    if state.slots == state.nthreads:
        assert len(state.executing) <= state.slots
    elif len(state.executing) > slots and not state.tight:  # (tight: those handed ahead before)
        live = [ts for _, _, ts in state.ready if ts.state == "ready" and state.tasks.get(ts.key) is ts]
        assert not live or not min(live) < max(state.executing), "a ready task should overtake"
    assert not state.executing & state.seceded
    for ts in state.executing | state.seceded:
        assert state.tasks.get(ts.key) is ts and ts.state in ("executing", "cancelled", "memory"), ts
    assert len(set(map(id, state.rejoining))) == len(state.rejoining), "a task waits twice to rejoin"
    for ts in state.rejoining:
        assert ts in state.seceded, ts
    if state.rejoining:
        # no new task takes a thread while a seceded one waits for it
        assert len(state.executing) >= state.nthreads, "a thread is free while a task waits to rejoin"
        return
    if state.paused:
        return  # nothing starts while paused
    live = [ts for _, _, ts in state.ready
            if ts.state == "ready" and state.tasks.get(ts.key) is ts and not ts.resources]
    if live:
        assert len(state.executing) >= slots, "a thread is idle while tasks are ready"
    first = min((ts for _, _, ts in state.constrained if ts.state == "ready" and state.tasks.get(ts.key) is ts),
                default=None)
    if first is not None and state.fits(first):
        assert len(state.executing) >= slots, f"{first} could run now"


def _validate_resources(state: WorkerState) -> None:
    """Held + available == total, for each resource; only tasks whose thread has not
    reported hold any."""
    total = state.total_resources
    assert state.available_resources.keys() == total.keys()
    for ts, held in state.holding.items():
        assert ts in state.executing or ts in state.seceded, f"{ts} holds {held} without a thread"
        assert held.keys() <= total.keys(), (ts, held)
    for name, amount in total.items():
        held_sum = sum(h.get(name, 0.0) for h in state.holding.values())
        available = state.available_resources[name]
        assert available >= -1e-9, f"{name}: {available} available"
        assert math.isclose(available + held_sum, amount, rel_tol=1e-9, abs_tol=1e-9), (name, available, held_sum)
    for ts in state.executing | state.seceded:
        assert (ts in state.holding) == bool(ts.resources), ts
