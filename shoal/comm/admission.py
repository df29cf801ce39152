"""Who may hold a connection before proving the cluster's secret, and what goes when
there is no room (the listeners' side of docs/protocol.md §3.2).

Theory of operation. A connection is a *stranger* from the moment it is accepted until
its handshake is done: over ``tls://`` the TLS handshake is part of that, the shoal
handshake (the proof of the secret) the rest. Each listener keeps an
:class:`AdmissionTable` of its strangers, also grouped by the peer's address, and a
count of its *established* connections (handshake done).

A newcomer is always taken; to make room, the table names the strangers that go, the
oldest first:

- ``max-handshaking-per-host``: the oldest stranger from the newcomer's address;
- ``max-handshaking``: the oldest stranger of the listener;
- ``max-connections`` (strangers and established together): the oldest stranger;
  only when every connection is established is the newcomer refused instead.

"Oldest" within two groups: strangers that have not yet sent one whole message (over
tls: not finished their TLS handshake) go first, by arrival; then those that have, by
when they did. A legitimate peer sends its first handshake message as it connects, so
it leaves the first group within a turn or two of the loop; connections that say
nothing, or dribble, stay in it and make room for it however fast they are opened.

Established connections never count against the stranger limits and are never named:
a flood of strangers costs an authenticated peer nothing but the loop's time. Refusing
the newcomer instead (what listeners did before) let a peer that opened connections and
said nothing lock everyone else of its address out for as long as it held them. Under
eviction it must keep opening them, and a peer that opens them faster than the
legitimate ones of its address finish their handshakes (sending a whole first message
each time, which needs no secret) can still crowd them out: limits per address cannot
tell two processes of one address apart.

Descriptors are the process's, not a listener's: :func:`relieve` evicts strangers of
every table of this process on the same event loop (in the same order, by sequence
numbers shared by all tables; another loop's connections are its own to close), when
accepting fails for want of descriptors, when few are left (:func:`descriptor_relief`:
fewer than ``descriptor-reserve`` of the limit), and when an outgoing connection cannot
get one. :func:`raise_descriptor_limit` lifts the process's
soft ``RLIMIT_NOFILE`` to its hard limit when a listener starts.

The table does no IO: it names entries; the listener closes their connections, through
the ``evict`` callable it gives each entry.
"""

from __future__ import annotations

import itertools
import logging
import resource
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator

from .. import config

__all__ = ["AdmissionTable", "Stranger", "relieve", "descriptor_relief", "raise_descriptor_limit",
           "check_limits", "PER_HOST", "HANDSHAKING", "CONNECTIONS", "DESCRIPTORS", "OUT_OF_DESCRIPTORS"]

logger = logging.getLogger("shoal.comm.admission")

#: why a stranger was evicted (the setting whose limit it made room under)
PER_HOST = "max-handshaking-per-host"
HANDSHAKING = "max-handshaking"
CONNECTIONS = "max-connections"
DESCRIPTORS = "descriptor-reserve"

_LIMITS = (HANDSHAKING, PER_HOST, CONNECTIONS)
#: what a listener out of descriptors tells the connection it refuses (its peer may
#: try again later: shoal.worker.outcomes.may_pass)
OUT_OF_DESCRIPTORS = "this process is out of file descriptors"
_seq = itertools.count()
#: every table of this process, for :func:`relieve`
_tables: weakref.WeakSet[AdmissionTable] = weakref.WeakSet()


def _no_op() -> None:
    pass


class Stranger:
    """A connection of an :class:`AdmissionTable`: a stranger until
    :meth:`AdmissionTable.establish`, then established. ``evict`` is what closes it (set by
    the listener)."""

    __slots__ = ("host", "seq", "order", "spoke", "table", "state", "evict", "__weakref__")

    def __init__(self, host: str, table: AdmissionTable):
        self.host = host
        self.seq = self.order = next(_seq)  # arrival, across every table of the process
        #: it sent a whole first message (tls: finished its TLS handshake); ``order``
        #: is then when it did
        self.spoke = False
        self.table = table
        self.state = "stranger"  # -> "established" | "gone"
        self.evict: Callable[[], None] = _no_op

    def __repr__(self) -> str:
        return f"<Stranger #{self.seq} from {self.host} {self.state}{' spoke' if self.spoke else ''}>"


class _Queue:
    """Strangers in the order they go: those that have not spoken, by arrival, then those
    that have, by when they spoke."""

    __slots__ = ("quiet", "spoken")

    def __init__(self) -> None:
        self.quiet: OrderedDict[Stranger, None] = OrderedDict()
        self.spoken: OrderedDict[Stranger, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.quiet) + len(self.spoken)

    def __iter__(self) -> Iterator[Stranger]:
        return itertools.chain(self.quiet, self.spoken)

    def first(self) -> Stranger:
        return next(iter(self.quiet or self.spoken))

    def add(self, entry: Stranger) -> None:
        (self.spoken if entry.spoke else self.quiet)[entry] = None

    def remove(self, entry: Stranger) -> None:
        del (self.spoken if entry.spoke else self.quiet)[entry]


def check_limits() -> None:
    """Raise ``ValueError`` when an admission setting is not a whole number of at least
    1, or ``descriptor-reserve`` is not a fraction in [0, 1)."""
    for name in _LIMITS:
        value = config.get(name)
        if type(value) is not int or value < 1:
            raise ValueError(f"{name} must be a whole number of at least 1, got {value!r}")
    reserve = config.get(DESCRIPTORS)
    if not isinstance(reserve, (int, float)) or not 0 <= reserve < 1:
        raise ValueError(f"{DESCRIPTORS} is a fraction of the descriptor limit, 0 to below 1; got {reserve!r}")


class AdmissionTable:
    """The strangers and established connections of one listener (see the module)."""

    def __init__(self, loop: object = None) -> None:
        #: the event loop of the listener (relieve() acts on the tables of its own
        #: loop only: evicting closes connections, which only their loop may do)
        self.loop = loop
        #: strangers in the order they go, in all and per peer address
        self._strangers = _Queue()
        self._by_host: dict[str, _Queue] = {}
        self.established = 0
        _tables.add(self)

    @property
    def strangers(self) -> int:
        return len(self._strangers)

    def strangers_from(self, host: str) -> int:
        group = self._by_host.get(host)
        return len(group) if group else 0

    def next_to_go(self) -> Stranger | None:
        """The stranger the next eviction names, if any."""
        return self._strangers.first() if self._strangers else None

    def admit(self, host: str) -> tuple[Stranger | None, list[tuple[Stranger, str]]]:
        """A connection from ``host`` came: its entry (``None``: refused, every
        connection of this listener being established and ``max-connections`` reached),
        and the strangers that must go to make room for it, each with the setting whose
        limit it goes for. Those are no longer in the table."""
        per_host, most, cap = (config.get(n) for n in (PER_HOST, HANDSHAKING, CONNECTIONS))
        out: list[tuple[Stranger, str]] = []
        group = self._by_host.get(host)
        while group and len(group) >= per_host:
            out.append((self._drop(group.first()), PER_HOST))
        strangers = self._strangers
        while strangers and len(strangers) >= most:
            out.append((self._drop(strangers.first()), HANDSHAKING))
        while strangers and len(strangers) + self.established >= cap:
            out.append((self._drop(strangers.first()), CONNECTIONS))
        if self.established >= cap:
            return None, out
        entry = Stranger(host, self)
        strangers.add(entry)
        self._by_host.setdefault(host, _Queue()).add(entry)
        return entry, out

    def spoke(self, entry: Stranger) -> None:
        """``entry`` sent a whole first message (over tls: finished its TLS handshake):
        it goes after every stranger that has not (nothing if it is no stranger here)."""
        if entry.state != "stranger" or entry.spoke or entry.table is not self:
            return
        self._strangers.remove(entry)
        self._by_host[entry.host].remove(entry)
        entry.spoke = True
        entry.order = next(_seq)
        self._strangers.add(entry)
        self._by_host[entry.host].add(entry)

    def establish(self, entry: Stranger) -> bool:
        """``entry``'s handshake is done: it counts as established from now on. Returns
        False (and changes nothing) when it is no longer a stranger of this table
        (evicted meanwhile)."""
        if entry.state != "stranger" or entry.table is not self:
            return False
        self._drop(entry)
        entry.state = "established"
        self.established += 1
        return True

    def leave(self, entry: Stranger) -> None:
        """``entry``'s connection is gone (whatever it was; again: nothing)."""
        if entry.state == "stranger":
            self._drop(entry)
        elif entry.state == "established":
            entry.state = "gone"
            self.established -= 1

    def _drop(self, entry: Stranger) -> Stranger:
        self._strangers.remove(entry)
        group = self._by_host[entry.host]
        group.remove(entry)
        if not group:
            del self._by_host[entry.host]
        entry.state = "gone"
        return entry

    def validate(self) -> None:
        """Check the invariants (for tests): both views hold the same strangers, each
        queue in its order, all in state ``stranger``; no count is negative."""
        everyone = list(self._strangers)
        assert sorted(e.seq for g in self._by_host.values() for e in g) == sorted(e.seq for e in everyone)
        assert all(g for g in self._by_host.values()), "an empty host group is kept"
        for host, group in [("", self._strangers), *self._by_host.items()]:
            for queue, spoke in ((group.quiet, False), (group.spoken, True)):
                orders = [e.order for e in queue]
                assert orders == sorted(orders) and all(e.spoke is spoke for e in queue), host
            assert not host or all(e.host == host for e in group), host
        assert all(e.state == "stranger" and e.table is self for e in everyone)
        assert self.established >= 0


def relieve(n: int, loop: object) -> int:
    """Evict ``n`` strangers of the listeners of this process that run on ``loop``, the
    ones that go first (those that have not spoken, the oldest first, then the others),
    to free their descriptors (which their connections release on the loop's next
    turns). Returns how many there were."""
    candidates = [e for t in list(_tables) if t.loop is loop for e in itertools.islice(t._strangers, n)]
    candidates.sort(key=lambda e: (e.spoke, e.order))
    victims = candidates[:n]
    for entry in victims:
        entry.table._drop(entry)
    for entry in victims:
        entry.evict()
    return len(victims)


def descriptor_relief(fd: int) -> int:
    """How many strangers to evict now that descriptor ``fd`` was opened: none while
    ``descriptor-reserve`` of the process's limit is free, else enough to give back a
    quarter of that reserve. The kernel hands out the lowest free number, so every
    descriptor below ``fd`` is in use: ``fd`` reaches the reserve only once the holes
    left by connections that closed are filled again. Evicting a couple of strangers
    there would let the next ones fill their holes and come back to the edge at once;
    a batch keeps the reserve free."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 0
    reserve = int(soft * config.get(DESCRIPTORS))
    if fd + 1 <= soft - reserve:
        return 0
    return max(4, reserve // 4)


_raised = False


def raise_descriptor_limit() -> tuple[int, int]:
    """Lift this process's soft ``RLIMIT_NOFILE`` to its hard limit (once per process;
    a hard limit of "unlimited" gives the kernel's ``nr_open``). Returns the soft and
    hard limits after. A limit that cannot be raised is left as it is (logged)."""
    global _raised
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if _raised:
        return soft, hard
    _raised = True
    target = hard
    if hard == resource.RLIM_INFINITY:
        target = _nr_open()
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            logger.info("cannot raise the descriptor limit from %d to %d: %s", soft, target, exc)
        else:
            logger.debug("raised the descriptor limit from %d to %d", soft, target)
            soft = target
    return soft, hard


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20
