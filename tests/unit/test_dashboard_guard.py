"""The dashboard's connection bounds (shoal.dashboard.guard): which connection makes
room for a new one, and the time a connection has to send a request head (fake
transports: no sockets)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("aiohttp")

from shoal.dashboard.guard import ConnectionGuard, ConnectionTable, Tracked  # noqa: E402


def conns(table: ConnectionTable, *hosts: str) -> list[Tracked]:
    made = [Tracked(h) for h in hosts]
    for c in made:
        assert table.admit(c) == (True, None)
    return made


def test_connections_are_taken_up_to_the_bounds():
    table = ConnectionTable(max_total=3, max_per_host=2)
    a, b, c = conns(table, "h1", "h1", "h2")
    assert len(table) == 3 and all(x in table for x in (a, b, c))


def test_the_oldest_idle_connection_that_has_not_logged_in_makes_room():
    table = ConnectionTable(max_total=4, max_per_host=4)
    a, b, c, d = conns(table, "h", "h", "h", "h")
    a.logged_in = True  # the oldest, but logged in
    b.busy = 1  # being answered
    new = Tracked("h")
    assert table.admit(new) == (True, c)
    assert c not in table and new in table and len(table) == 4
    # then d, then the newer ones that have not logged in: a stays while there are any
    assert table.admit(Tracked("h"))[1] is d
    assert table.admit(Tracked("h"))[1] is new
    assert a in table and b in table


def test_logged_in_idle_connections_go_when_no_other_is_idle():
    table = ConnectionTable(max_total=2, max_per_host=2)
    a, b = conns(table, "h", "h")
    a.logged_in = b.logged_in = True
    assert table.admit(Tracked("h"))[1] is a


def test_when_every_connection_is_busy_the_new_one_is_refused():
    table = ConnectionTable(max_total=2, max_per_host=2)
    a, b = conns(table, "h", "h")
    a.busy = b.busy = 1
    new = Tracked("h")
    assert table.admit(new) == (False, None)
    assert new not in table and len(table) == 2


def test_a_host_past_its_bound_makes_room_among_its_own_connections():
    table = ConnectionTable(max_total=10, max_per_host=2)
    other, a, b = conns(table, "other", "h", "h")
    c, d = Tracked("h"), Tracked("h")
    assert table.admit(c) == (True, a)  # not `other`, older but of another host
    assert table.admit(d) == (True, b) and other in table
    # the host's own all busy: refused, though there is room in all
    c.busy = d.busy = 1
    assert table.admit(Tracked("h")) == (False, None)
    assert table.admit(Tracked("third")) == (True, None)


def test_removing_twice_is_harmless_and_frees_the_room():
    table = ConnectionTable(max_total=1, max_per_host=1)
    (a,) = conns(table, "h")
    a.busy = 1
    table.remove(a)
    table.remove(a)
    assert len(table) == 0 and table.admit(Tracked("h")) == (True, None)


@pytest.mark.parametrize("total, per_host", [(0, 1), (1, 0), (-1, 5)])
def test_bounds_below_one_are_refused(total, per_host):
    with pytest.raises(ValueError, match="bounds must be >= 1"):
        ConnectionTable(total, per_host)


def test_a_negative_header_timeout_is_refused():
    with pytest.raises(ValueError, match="seconds >= 0"):
        ConnectionGuard(10, 10, -1.0)


class FakeTransport:
    """What the guard uses of a transport; ``looked`` is set once the guard has asked
    ``looks`` times how much it has left to send (``buffered``)."""

    def __init__(self, host: str = "127.0.0.1", buffered: int = 0, looks: int = 0) -> None:
        self.host = host
        self.buffered = buffered
        self.aborted = asyncio.Event()
        self.looks = looks
        self.looked = asyncio.Event()

    def get_extra_info(self, name: str) -> object:
        return (self.host, 1234) if name == "peername" else None

    def get_write_buffer_size(self) -> int:
        self.looks -= 1
        if self.looks <= 0:
            self.looked.set()
        return self.buffered

    def abort(self) -> None:
        self.aborted.set()


async def test_a_connection_that_sends_no_request_in_time_is_aborted():
    guard = ConnectionGuard(10, 10, header_timeout=0.05)
    silent, answered = FakeTransport(), FakeTransport()
    assert guard.admit(silent) and guard.admit(answered)
    guard.began(answered, logged_in=False)  # a request came in time: its time stops
    await asyncio.wait_for(silent.aborted.wait(), 10)
    assert not answered.aborted.is_set() and guard.dropped == 1
    guard.ended(answered)  # answered: the time for its next request starts
    await asyncio.wait_for(answered.aborted.wait(), 10)
    assert len(guard.table) == 0


async def test_a_logged_in_reader_still_being_sent_an_answer_is_left_to_finish():
    guard = ConnectionGuard(10, 10, header_timeout=0.02)
    reader = FakeTransport(buffered=1 << 20, looks=3)
    assert guard.admit(reader)
    guard.began(reader, logged_in=True)
    guard.ended(reader)
    # its time runs out three times, and is given again while it has bytes to be sent
    await asyncio.wait_for(reader.looked.wait(), 10)
    assert not reader.aborted.is_set()
    reader.buffered = 0  # all sent: when its time runs out next, it goes
    await asyncio.wait_for(reader.aborted.wait(), 10)
    # one that has not logged in is not given that: it goes when its time runs out
    other = FakeTransport(buffered=1 << 20)
    assert guard.admit(other)
    guard.began(other, logged_in=False)
    guard.ended(other)
    await asyncio.wait_for(other.aborted.wait(), 10)


async def test_a_new_connection_past_the_bound_drops_the_oldest_idle_one():
    guard = ConnectionGuard(2, 2, header_timeout=0)
    first, second, third = FakeTransport(), FakeTransport(), FakeTransport()
    assert guard.admit(first) and guard.admit(second)
    guard.began(second, logged_in=True)
    guard.ended(second)
    assert guard.admit(third)
    assert first.aborted.is_set() and not second.aborted.is_set() and guard.dropped == 1
    guard.began(second, logged_in=True)
    guard.began(third, logged_in=False)
    assert not guard.admit(FakeTransport()) and guard.refused == 1  # (its caller closes it)
    guard.forget(second)
    guard.forget(third)
    guard.close()
    assert len(guard.table) == 0
