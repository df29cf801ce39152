"""The admission table of a listener (shoal.comm.admission): who goes when a newcomer
needs room. No sockets, no loop: entries in, names out."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal import config
from shoal.comm import admission
from shoal.comm.admission import CONNECTIONS, HANDSHAKING, PER_HOST, AdmissionTable, Stranger


@pytest.fixture
def table() -> Iterator[AdmissionTable]:
    t = AdmissionTable()
    yield t
    t.validate()
    for entry in list(t._strangers):  # no table of this test is left for relieve() to find
        t.leave(entry)


def _admit(table: AdmissionTable, host: str) -> tuple[Stranger, list[tuple[Stranger, str]]]:
    entry, out = table.admit(host)
    assert entry is not None
    return entry, out


def test_a_newcomer_from_a_full_host_closes_that_hosts_oldest(table: AdmissionTable) -> None:
    with config.set(max_handshaking_per_host=2, max_handshaking=10):
        a1, _ = _admit(table, "a")
        b1, _ = _admit(table, "b")
        a2, _ = _admit(table, "a")
        a3, out = _admit(table, "a")
        assert out == [(a1, PER_HOST)]
        assert a1.state == "gone" and table.strangers_from("a") == 2 and table.strangers == 3
        _, out = _admit(table, "a")
        assert out == [(a2, PER_HOST)]  # b1 is older, but of another host
        assert b1.state == "stranger"


def test_strangers_that_spoke_go_after_those_that_did_not(table: AdmissionTable) -> None:
    """A stranger that sent a whole message (tls: finished its TLS handshake) is kept
    over silent or dribbling ones, however many newer ones come."""
    with config.set(max_handshaking_per_host=3, max_handshaking=10):
        legit, _ = _admit(table, "a")
        table.spoke(legit)
        for _ in range(20):  # a flood of silent ones: each closes the oldest silent one
            _, out = _admit(table, "a")
            assert [e for e, _ in out] != [legit]
        assert legit.state == "stranger" and table.strangers_from("a") == 3
        # among those that spoke, the one that spoke first goes first
        s1, s2 = [e for e in table._by_host["a"].quiet]
        table.spoke(s2)
        table.spoke(s1)
        _, out = _admit(table, "a")
        assert out == [(legit, PER_HOST)]
        _, out = _admit(table, "a")
        assert out and out[0][0] not in (s1, s2)  # the newcomer before, silent


def test_a_newcomer_at_max_handshaking_closes_the_oldest_of_all(table: AdmissionTable) -> None:
    with config.set(max_handshaking_per_host=10, max_handshaking=3):
        first = [_admit(table, h)[0] for h in ("a", "b", "c")]
        _, out = _admit(table, "d")
        assert out == [(first[0], HANDSHAKING)]
        assert table.strangers == 3 and table.next_to_go() is first[1]


def test_established_connections_never_count_against_the_stranger_limits(table: AdmissionTable) -> None:
    with config.set(max_handshaking_per_host=2, max_handshaking=2):
        for _ in range(5):
            entry, out = _admit(table, "a")
            assert out == []
            assert table.establish(entry)
        assert table.established == 5 and table.strangers == 0
        s1, _ = _admit(table, "a")
        s2, out = _admit(table, "a")
        assert out == []
        _, out = _admit(table, "a")
        assert out == [(s1, PER_HOST)] and table.established == 5


def test_max_connections_closes_a_stranger_and_refuses_only_when_all_are_established(
        table: AdmissionTable) -> None:
    with config.set(max_connections=3):
        e1, _ = _admit(table, "a")
        e2, _ = _admit(table, "a")
        assert table.establish(e1) and table.establish(e2)
        s1, _ = _admit(table, "b")
        s2, out = _admit(table, "b")
        assert out == [(s1, CONNECTIONS)] and table.strangers == 1
        assert table.establish(s2)
        entry, out = table.admit("c")
        assert entry is None and out == []  # three established: the newcomer is refused
        table.leave(e1)
        entry, out = table.admit("c")
        assert entry is not None and out == []


def test_an_evicted_stranger_cannot_be_established_and_leaving_twice_does_nothing(
        table: AdmissionTable) -> None:
    with config.set(max_handshaking=1):
        old, _ = _admit(table, "a")
        new, out = _admit(table, "a")
        assert out == [(old, HANDSHAKING)]
        assert not table.establish(old)
        table.leave(old)
        assert table.strangers == 1 and table.established == 0
        assert table.establish(new)
        table.leave(new)
        table.leave(new)
        assert table.established == 0


def test_relieve_evicts_the_strangers_that_go_first_of_every_table_of_the_loop() -> None:
    loop, other_loop = object(), object()
    t1, t2, t3 = AdmissionTable(loop), AdmissionTable(loop), AdmissionTable(other_loop)
    evicted: list[Stranger] = []
    try:
        entries = []
        for table in (t3, t1, t2, t1, t2, t1):
            entry, _ = _admit(table, "a")
            entry.evict = lambda e=entry: evicted.append(e)
            entries.append(entry)
        assert t1.establish(entries[1])  # established: never evicted
        t2.spoke(entries[2])  # spoke: after those that have not
        assert admission.relieve(2, loop) == 2
        assert evicted == [entries[3], entries[4]]
        assert admission.relieve(5, loop) == 2  # all there are on that loop
        assert evicted[2:] == [entries[5], entries[2]]
        assert t1.strangers == t2.strangers == 0 and t3.strangers == 1  # another loop's: left alone
        for t in (t1, t2, t3):
            t.validate()
    finally:
        for t in (t1, t2, t3):
            for e in list(t._strangers):
                t.leave(e)


@pytest.mark.parametrize("name,value", [
    ("max_handshaking", 0), ("max_handshaking_per_host", -1), ("max_connections", 2.5),
    ("descriptor_reserve", 1.0), ("descriptor_reserve", -0.1),
])
def test_bad_limits_are_clear_errors(name: str, value: object) -> None:
    with config.set(**{name: value}):
        with pytest.raises(ValueError, match=name.replace("_", "-")):
            admission.check_limits()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "spoke", "establish", "leave"]), st.integers(0, 3),
                          st.integers(0, 50)), max_size=60),
       st.integers(1, 4), st.integers(1, 6), st.integers(1, 8))
def test_the_limits_hold_after_any_sequence(ops: list[tuple[str, int, int]], per_host: int, most: int,
                                            cap: int) -> None:
    table = AdmissionTable()
    entries: list[Stranger] = []
    try:
        with config.set(max_handshaking_per_host=per_host, max_handshaking=most, max_connections=cap):
            for op, host, pick in ops:
                if op == "admit":
                    before = list(table._strangers)
                    entry, out = table.admit(f"h{host}")
                    gone = [e for e, _ in out]
                    # only strangers go; one that spoke only when none that did not is left
                    # of its scope (its host's, for the per-host limit; all, else)
                    assert all(e in before for e in gone)
                    kept = [e for e in before if e not in gone]
                    for e, why in out:
                        if e.spoke:
                            scope = [k for k in kept if why != PER_HOST or k.host == e.host]
                            assert all(k.spoke for k in scope), (e, why, scope)
                    if entry is None:
                        assert table.established >= cap and not before
                    else:
                        entries.append(entry)
                elif entries:
                    entry = entries[pick % len(entries)]
                    {"spoke": table.spoke, "establish": table.establish, "leave": table.leave}[op](entry)
                table.validate()
                assert table.strangers <= most
                assert all(table.strangers_from(f"h{h}") <= per_host for h in range(4))
                assert table.strangers + table.established <= cap
    finally:
        for e in list(table._strangers):
            table.leave(e)
