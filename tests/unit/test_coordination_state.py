"""The scheduler's coordination state (shoal.scheduler.coordination) without IO: waiters
are plain objects, the scheduler a fake that records what it is asked to hold."""

from __future__ import annotations

from typing import Any

import pytest

from shoal.scheduler.coordination import GONE, PENDING, Coordination, Value


class FakeHost:
    def __init__(self, keys: set[Any] = frozenset({"a", "b", "c"}), clients: set[str] = frozenset({"c1", "c2"})):
        self.keys = set(keys)
        self.clients = set(clients)
        self.log: list[tuple[str, str, list[Any]]] = []

    def hold(self, holder: str, keys: list[Any]) -> None:
        self.log.append(("hold", holder, keys))

    def release(self, holder: str, keys: list[Any]) -> None:
        self.log.append(("release", holder, keys))

    def forget_holder(self, holder: str) -> None:
        self.log.append(("forget", holder, []))

    def knows(self, key: Any) -> bool:
        return key in self.keys

    def connected(self, client: str) -> bool:
        return client in self.clients


class W:
    """A waiter: answered once; ``dead`` ones (their connection closed) report done."""

    def __init__(self, dead: bool = False):
        self.results: list[Any] = []
        self.dead = dead

    def done(self) -> bool:
        return self.dead or bool(self.results)

    def set_result(self, result: Any) -> None:
        if not self.results:
            self.results.append(result)

    @property
    def result(self) -> Any:
        assert self.results, "not answered"
        return self.results[0]


@pytest.fixture
def host() -> FakeHost:
    return FakeHost()


@pytest.fixture
def co(host: FakeHost) -> Coordination:
    return Coordination(host)


def test_a_variable_holds_its_key_and_hands_it_to_readers(co, host):
    w = W()
    assert co.variable_get("v", "c1", w) is PENDING
    co.variable_set("v", Value("a"))
    assert w.result == Value("a")
    assert host.log == [("hold", "variable:'v'", ["a"]), ("hold", "c1", ["a"])]
    host.log.clear()
    co.variable_set("v", Value("a"))  # the same future again: still held once
    co.variable_set("v", Value(data=b"x"))
    assert host.log == [("release", "variable:'v'", ["a"])]
    assert co.variable_get("v", "c2", None) == Value(data=b"x")
    co.variable_delete("v")
    assert co.variable_get("v", "c2", None) is PENDING
    assert co.waiting() == 0


def test_a_key_the_scheduler_forgot_is_not_held(co, host):
    co.variable_set("v", Value("gone"))
    assert host.log == []
    assert co.variable_get("v", "c1", None) == Value("gone")  # the reader's future errs on its own


def test_a_timed_out_waiter_is_forgotten(co):
    w = W()
    assert co.queue_get("q", 0, False, "c1", w) is PENDING
    co.forget(w)
    assert co.queue_put("q", 0, Value(data=1), "c1", None) is True
    assert not w.results and co.queue_size("q", 0) == 1 and co.waiting() == 0


def test_queue_order_batches_and_maxsize(co, host):
    assert co.queue_put("q", 2, Value("a"), "c1", None) is True
    assert co.queue_put("q", 2, Value("a"), "c1", None) is True  # one key twice: counted
    putter = W()
    assert co.queue_put("q", 2, Value(data=3), "c1", putter) is PENDING  # full
    assert co.held("queue:'q'") == {"a": 2}
    assert co.queue_get("q", 2, False, "c2", None) == Value("a")
    assert putter.result is True  # room made: it went in
    assert co.queue_get("q", 2, True, "c2", None) == [Value("a"), Value(data=3)]
    assert co.held("queue:'q'") == {}
    assert host.log == [("hold", "queue:'q'", ["a"]), ("hold", "c2", ["a"]), ("hold", "c2", ["a"]),
                        ("release", "queue:'q'", ["a"])]
    many = W()
    assert co.queue_get("q", 2, 2, "c1", many) is PENDING
    co.queue_put("q", 2, Value(data=1), "c2", None)
    assert not many.results
    co.queue_put("q", 2, Value(data=2), "c2", None)
    assert many.result == [Value(data=1), Value(data=2)]
    assert co.queue_get("q", 2, True, "c1", None) == []


def test_semaphore_leases_go_in_order_and_skip_closed_requests(co):
    assert co.semaphore_acquire("s", 1, "l1", "c1", None) is True
    assert co.semaphore_acquire("s", 1, "l1", "c1", None) is True  # the same lease: idempotent
    dead, alive = W(dead=True), W()
    assert co.semaphore_acquire("s", 1, "l2", "c2", dead) is PENDING
    assert co.semaphore_acquire("s", 1, "l3", "c2", alive) is PENDING
    assert co.semaphore_release("s", "l1") is True
    assert alive.result is True and co.semaphore_value("s") == 1
    assert dead.results == [GONE]  # its connection closed: nothing granted, its handler told
    assert co.semaphore_release("s", "l1") is False
    with pytest.raises(ValueError, match="Inconsistent max leases"):
        co.semaphore_acquire("s", 2, "l4", "c1", None)
    with pytest.raises(ValueError, match="connected"):
        co.semaphore_acquire("s", 1, "l5", "stranger", None)


def test_a_departed_client_loses_its_leases_subscriptions_and_waiters(co):
    assert co.semaphore_acquire("lock", 1, "mine", "c1", None) is True
    theirs, mine = W(), W()
    co.semaphore_acquire("lock", 1, "theirs", "c2", theirs)
    co.event_wait("e", "c1", mine)
    co.subscribe("ch", "sub1", "c1")
    co.client_removed("c1")
    assert theirs.result is True and co.semaphore_value("lock") == 1
    assert mine.result is GONE
    assert "sub1" not in co.subscribers
    co.publish("ch", "nobody hears this")


def test_events(co):
    assert co.event_wait("e", "c1", None) is PENDING
    w1, w2 = W(), W()
    co.event_wait("e", "c1", w1)
    co.event_wait("e", "c2", w2)
    co.event_set("e")
    assert w1.result is True and w2.result is True
    assert co.event_is_set("e") and co.event_wait("e", "c1", None) is True
    co.event_clear("e")
    assert not co.event_is_set("e") and "e" not in co.events


def test_a_subscriber_keeps_a_bounded_buffer(host):
    co = Coordination(host, subscriber_buffer=3)
    co.subscribe("ch", "s", "c1")
    co.subscribe("ch", "s-stranger", "nobody")  # no stream: no subscriber
    for i in range(5):
        co.publish("ch", i)
    assert co.subscribers["s"].dropped == 2
    assert co.subscriber_get("ch", "s", "c1", None) == [2, 3, 4]
    w = W()
    assert co.subscriber_get("ch", "s", "c1", w) is PENDING
    co.publish("ch", "next")
    assert w.result == ["next"]
    with pytest.raises(ValueError):
        co.subscriber_get("ch", "s", "c2", None)  # another client's
    assert "s-stranger" not in co.subscribers


def test_datasets_publish_atomically_and_hold_their_keys(co, host):
    co.publish_put(["x", "y"], [["a"], []], [b"X", b"Y"], override=False)
    with pytest.raises(KeyError, match="already exists"):
        co.publish_put(["z", "x"], [[], []], [b"Z", b"X2"], override=False)
    assert co.publish_list() == ["x", "y"]  # z was not published either
    co.publish_put(["x"], [["a", "b"]], [b"X2"], override=True)
    assert co.publish_get(["x", "nope"]) == [b"X2", None]
    co.publish_delete(["x", "nope"])
    assert host.log == [("hold", "dataset:'x'", ["a"]), ("hold", "dataset:'x'", ["b"]),
                        ("forget", "dataset:'x'", [])]


def test_flush_markers_are_bounded_and_waited_for(host):
    co = Coordination(host, flush_markers=2)
    w = W()
    assert co.wait_flush("u1", "c1", w) is PENDING
    co.flush_seen("u1")
    assert w.result is True
    for uid in ("u2", "u3", "u4"):
        co.flush_seen(uid)
    assert co.wait_flush("u2", "c1", None) is PENDING  # forgotten: the oldest went
    assert co.wait_flush("u4", "c1", None) is True
    assert co.wait_flush("never", "gone-client", None) is True  # nothing more will come


def test_close_answers_every_waiter(co):
    ws = [W(), W()]
    co.variable_get("v", "c1", ws[0])
    co.semaphore_acquire("s", 1, "l", "c1", None)
    co.semaphore_acquire("s", 1, "l2", "c2", ws[1])
    co.close()
    assert [w.result for w in ws] == [GONE, GONE] and co.waiting() == 0
