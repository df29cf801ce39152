"""The ``shoal.same-host`` serializer family: to a peer that maps this host's shared
memory, a buffer that already lies in a segment travels as a reference to it, and a
large private buffer through a transfer segment made for that one message (with a
lease, unlinked by the receiver). Registered when :mod:`shoal.comm` is imported.

Also here, for task payloads (:mod:`shoal.taskspec`) and the processes that forward
them: :func:`place_buffers` puts the large buffers of an object that may be sent more
than once in a segment this process keeps for as long as that object lives;
:func:`hand_over_buffers` puts them in a transfer segment for the receiver to take over;
:func:`adopt_refs` is that taking over, by a receiver that keeps the value serialized,
and :func:`forward_refs` what such a receiver sends on; :func:`map_refs` turns
references back into buffers.

A receiver removes or renames a transfer segment (flag 1) only if the sender leased it
on the connection the entry came on (its table entry lists lease ids,
:data:`~shoal.protocol.core.decoding_leases`) and, when the transport knows the peer's
pid (:data:`receiving_from`), only if the segment is named after that pid. Any other
flag-1 ref is mapped like a flag-0 one and its file left alone. As that pid is only
claimed, the file must moreover say it is a transfer (its header, :mod:`.shm`): a value
segment, whose name and token its owner's clients learn, is never taken over, and a
kept transfer becomes a value segment. A peer cannot make this process remove or take
over segments another process owns. Refs are parsed as
:class:`~shoal.protocol.messages.SegmentRef`.
"""

from __future__ import annotations

import contextvars
import logging
import os
import pickle
import weakref
from collections.abc import Sequence
from typing import Any

from ..protocol import SAME_HOST
from ..protocol.core import decoding_leases
from ..protocol.messages import SegmentRef
from .shm import (
    ShmUnavailable,
    enabled,
    fill_segment,
    locate,
    map_segment,
    registry,
    retire_later,
    unlink,
    work_off,
)
from .shm_files import DATA_OFFSET, PREFIX, align, segment_path
from .shm_handover import adopt_segment, give_back_later, reclaim_returned

__all__ = ["TRANSFER_MIN_BYTES", "shm_bytes", "PlacedBuffers", "place_buffers", "hand_over_buffers",
           "map_refs", "adopt_refs", "forward_refs", "receiving_from"]

logger = logging.getLogger("shoal.comm.shm_family")

#: private buffers at least this large cross to a same-host peer through a new segment
TRANSFER_MIN_BYTES = 1 << 20

#: the pid of the peer whose message is being decoded, as its transport authenticated
#: it (``None``: unknown). The transport sets it around :func:`~shoal.protocol.loads`;
#: while it is set, a transfer segment (flag-1 ref) is removed or renamed only if its
#: name says that process made it (``shoal-<pid>-...``): the others are only mapped.
receiving_from: contextvars.ContextVar[int | None] = contextvars.ContextVar("receiving_from", default=None)
#: whether a transfer named after another process than the peer was reported
warned_foreign: list[bool] = []


def _from_peer(name: str) -> bool:
    """Whether the transfer segment ``name`` may be the peer's own: always when the
    peer's pid is unknown; else only a name made by that pid (warned once if not)."""
    pid = receiving_from.get()
    if pid is None or name.startswith(f"{PREFIX}{pid}-"):
        return True
    if not warned_foreign:
        warned_foreign.append(True)
        logger.warning("process %d sent a transfer segment named %r, which is not named after it: "
                       "mapped, but neither removed nor taken over (further ones are not reported)",
                       pid, name[:300])
    return False


def _same_host_dumps(obj: Any, destination: str) -> tuple[dict[str, Any], list[Any]]:
    """Pickle 5. A buffer that already lives in a segment travels as (name, size,
    offset, length). The large private buffers are copied into one transfer segment,
    from offset 4096 (room for the value's pickle stream in front, should the receiver
    keep the segment as the value's), that the receiver takes (flag 1); a lease removes
    it should the receiver never get it. Small buffers travel as frames."""
    from ..protocol import leases
    from ..protocol.serialize import pickle_dumps

    buffers: list[pickle.PickleBuffer] = []
    data = pickle_dumps(obj, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    refs: list[Any] = [None] * len(raws)
    use = enabled()
    private: list[int] = []
    for i, raw in enumerate(raws):
        where = locate(raw) if use else None
        if where is not None and not os.path.exists(segment_path(where[0])):
            where = None  # its name was removed: a receiver could not map it
        if where is not None:
            name, size, offset, length, token = where
            refs[i] = [name, size, offset, length, 0, token]
        elif use and raw.nbytes >= TRANSFER_MIN_BYTES:
            private.append(i)
    if private and leases.active():
        try:
            handed = hand_over_buffers([raws[i] for i in private])
        except ShmUnavailable:
            handed = None
        if handed is not None:
            for i, ref in zip(private, handed.refs):
                refs[i] = ref
    frames: list[Any] = [data, *(raw for raw, ref in zip(raws, refs) if ref is None)]
    return ({"refs": refs} if any(r is not None for r in refs) else {}), frames


def _same_host_loads(header: dict[str, Any], frames: Sequence[Any]) -> Any:
    refs = header.get("refs")
    if not refs:
        return pickle.loads(frames[0], buffers=frames[1:])
    return pickle.loads(frames[0], buffers=map_refs(refs, frames[1:]))


def map_refs(refs: Sequence[Any], frames: Sequence[Any], own: bool = False) -> list[Any]:
    """The buffers a family header's ``refs`` describe: each ``None`` takes the next
    frame, each ``[name, size, offset, length, flag, token]`` is mapped from its
    segment (copy-on-write; with ``own`` in mappings of their own, see
    :func:`~.shm.map_segment`); with flag 1 (a transfer) the name is removed once mapped,
    or the file kept under a name of this process (``registry.adopt_transfers``), but
    only for an entry its sender leased, and named after the peer (module docstring);
    any other flag-1 ref counts as flag 0. Raises ``FileNotFoundError`` for a segment
    that is gone or no segment of this user, ``ValueError`` for refs that do not
    describe buffers (a name not in shoal's form included)."""
    buffers: list[Any] = []
    it = iter(frames)
    views: dict[tuple[str, str], memoryview] = {}  # one mapping per segment and call
    leased = bool(decoding_leases.get())
    for ref in refs:
        if ref is None:
            try:
                buffers.append(next(it))
            except StopIteration:
                raise ValueError("the refs name more frames than were sent") from None
            continue
        r = SegmentRef.parse(ref)
        # a transfer (flag 1) is ours once mapped: a worker keeps it under a name of its
        # own (its peers may map it then); any other process removes the name
        take = r.flag == 1 and leased and _from_peer(r.name)
        adopt = take and not own and registry.adopt_transfers
        view = views.get((r.name, r.token))
        if view is None or view.nbytes < r.size:
            view = views[r.name, r.token] = map_segment(r.name, r.size, r.token, own=own, adopt=adopt, take=take)
        buffers.append(view[r.offset : r.offset + r.length])
        if take and not adopt:
            try:
                os.unlink(segment_path(r.name))
            except FileNotFoundError:
                pass
    return buffers


class PlacedBuffers:
    """The large buffers of one object copied into a segment; ``refs`` describe them
    for a header (nil for the buffers left as frames).

    With ``keep`` (``(name, size)``) the segment is this process's for as long as the
    object holding this lives (a task's payload, which its scheduler may send again to
    another worker); then it goes back to this process's pool, where it is reused once
    no reader maps it any more (see :mod:`.shm`). Without, it was handed over."""

    __slots__ = ("refs", "__weakref__")

    def __init__(self, refs: list[Any], keep: tuple[str, int] | None = None):
        self.refs = refs
        if keep is not None:
            # a finalizer may run inside the garbage collector: it only queues the
            # retirement; at exit every segment is unlinked anyway
            weakref.finalize(self, retire_later, *keep).atexit = False


def place_buffers(raws: Sequence[memoryview], min_bytes: int = TRANSFER_MIN_BYTES) -> PlacedBuffers | None:
    """Copy the buffers of ``raws`` that hold at least ``min_bytes`` into one segment
    this process keeps (a pooled one when one fits: no page faults), with flag-0 refs;
    ``None`` when none is that large or shared memory is off. Raises
    :class:`ShmUnavailable` (nothing is left behind)."""
    work_off()  # segments of payloads that are gone: reusable now
    # the layout of a placed value: one segment size fits either
    placed = _copy_big(raws, min_bytes, DATA_OFFSET, flag=0)
    if placed is None:
        return None
    refs, name, size = placed
    return PlacedBuffers(refs, keep=(name, size))


def hand_over_buffers(raws: Sequence[memoryview], min_bytes: int = TRANSFER_MIN_BYTES) -> PlacedBuffers | None:
    """Like :func:`place_buffers`, but for the receiver to take over: flag-1 refs to a
    transfer segment (buffers from offset 4096: room for the value's pickle stream, should
    the receiver keep the segment as the value's), under a lease (inside a transport's
    serialization) that removes it should the receiver neither map nor adopt it."""
    from ..protocol import leases

    if any(r.nbytes >= min_bytes for r in raws) and enabled():
        reclaim_returned()  # segments the receiver gave back: their pages are there
    placed = _copy_big(raws, min_bytes, DATA_OFFSET, flag=1)
    if placed is None:
        return None
    refs, name, _ = placed
    leases.lease(lambda: unlink(name))
    return PlacedBuffers(refs)


def _copy_big(raws: Sequence[memoryview], min_bytes: int, start: int, flag: int) -> tuple[list[Any], str, int] | None:
    big = [i for i, r in enumerate(raws) if r.nbytes >= min_bytes]
    if not big or not enabled():
        return None
    pos = start
    spans: dict[int, int] = {}
    for i in big:
        spans[i] = pos
        pos = align(pos + raws[i].nbytes)
    name, size, token = fill_segment(pos, [(spans[i], raws[i]) for i in big], keep=flag == 0)
    refs: list[Any] = [None] * len(raws)
    for i in big:
        refs[i] = SegmentRef(name, size, spans[i], raws[i].nbytes, flag, token).to_list()
    return refs, name, size


def shm_bytes(obj: Any) -> int:
    """Bytes of ``obj``'s buffers that live in segments (what a same-host peer maps)."""
    buffers: list[pickle.PickleBuffer] = []
    try:
        pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - a __reduce__ may raise anything; sending it says what
        return 0
    total = 0
    for b in buffers:
        raw = b.raw()
        if locate(raw) is not None:
            total += raw.nbytes
    return total


def adopt_refs(s: Any) -> bool:
    """A process that keeps a received value serialized (to forward it later) takes
    over its transfer segments (flag-1 refs): each file is renamed to a name of this
    process, the refs now name it with flag 0, and ``s.keep`` holds it for as long as
    ``s`` lives (then it is given back to its maker, or removed). True if it took any:
    the sender's lease may end. A file that is gone or holds another generation stays
    named as it was (decoding it fails); so does one not named after the peer
    (:data:`receiving_from`). Called only for entries that came with lease ids."""
    refs = s.header.get("refs") if isinstance(s.header, dict) else None
    if not isinstance(refs, list) or not enabled():
        return False
    renamed: dict[str, str] = {}
    for i, raw in enumerate(refs):
        if raw is None:
            continue
        try:
            ref = SegmentRef.parse(raw)
        except ValueError:
            continue  # left as it came: decoding it fails
        if ref.flag != 1:
            continue
        if ref.name not in renamed:
            if not _from_peer(ref.name):
                continue
            new = adopt_segment(ref.name, ref.token)
            if new is None:
                continue
            renamed[ref.name] = new
        refs[i] = SegmentRef(renamed[ref.name], ref.size, ref.offset, ref.length, 0, ref.token).to_list()
    if not renamed:
        return False
    s.keep = [_Held(new, _maker(old)) for old, new in renamed.items()]
    return True


def _maker(name: str) -> int | None:
    """The pid a segment name says made it (``shoal-<pid>-...``), if it says one."""
    pid = name[len("shoal-"):].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


class _Held:
    """A segment this process adopted for a value it keeps serialized: when the value
    is gone, given back to the process that made it (a client of this scheduler, for
    its next arguments: no fresh pages) or removed."""

    __slots__ = ("__weakref__",)

    def __init__(self, name: str, maker: int | None):
        weakref.finalize(self, give_back_later, name, maker).atexit = False


def forward_refs(s: Any, destination: str, lead: int) -> tuple[dict[str, Any], list[Any]]:
    """What to send for a value kept serialized: as it is to a same-host peer; to any
    other, its referenced buffers as frames again (``lead``: the family's frames before
    the buffers)."""
    refs = s.header.get("refs") if isinstance(s.header, dict) else None
    if destination == SAME_HOST or not refs:
        return s.header, s.frames
    header = {k: v for k, v in s.header.items() if k != "refs"}
    return header, [*s.frames[:lead], *map_refs(refs, s.frames[lead:])]


def _register_family() -> None:
    from ..protocol import register_serializer
    from ..protocol.serialize import register_forwarding

    register_serializer(object, _same_host_dumps, _same_host_loads, destinations=[SAME_HOST],
                        name="shoal.same-host")
    # refs in the headers of the families that carry them: before their buffers come
    # one frame (the pickle) and two (function, arguments: shoal.taskspec) respectively
    register_forwarding("shoal.same-host", adopt_refs, lambda s, destination: forward_refs(s, destination, 1))
    register_forwarding("shoal.runspec", adopt_refs, lambda s, destination: forward_refs(s, destination, 2))


_register_family()
