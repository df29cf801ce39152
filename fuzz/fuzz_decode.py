"""Coverage-guided fuzzing of what shoal does with bytes a peer sent (atheris).

Targets, chosen by the first byte of each input (see :func:`one_input`):

0. ``shoal.protocol.core.loads(frames, deserialize=False)``: what the scheduler does
   with every message (it decodes only plain bytes and big ints, and may adopt the
   side channels of opaque entries that came with lease ids);
1. ``loads(frames, deserialize=True)``: what workers and clients do;
2. ``shoal.comm.handshake.decode_stranger([frame])``: a handshake message;
3. ``shoal.comm.framing.FrameProtocol`` as a new connection's parser (a stranger's
   limits): the bytes are fed in chunks through ``get_buffer``/``buffer_updated``,
   every message it delivers goes to ``decode_stranger``; after three of them that
   decode the parser's limits are lifted (``set_limits()``, as the handshake does)
   and the rest of the stream is read as an authenticated peer's messages
   (``loads(..., deserialize=False)``);
4. the same parser after ``set_limits()`` (an authenticated peer, the configured
   limits), every message to ``loads(..., deserialize=False)``;
5. the same with small limits (``set_limits(16, 4096)``), every message to
   ``loads(..., deserialize=True)``.

What is expected (docs/protocol.md §2.3, the docstrings of ``loads`` and
``decode_stranger``): :class:`~shoal.errors.ProtocolError` for bytes that do not form a
message, and any exception raised inside a serializer family's decoder (called through
``shoal.protocol.serialize.deserialize``: an unknown family's ``KeyError``, a pickle's
``UnpicklingError``, ...), which a transport turns into ``DeserializationError``. A
parser fails only by setting its ``error`` to a ``ProtocolError``. Anything else
escaping (or a crash, a hang, memory beyond ``-rss_limit_mb``) is a finding.

Two things keep the fuzzer from doing harm, and neither changes shoal's decoders:

- ``pickle.loads`` is replaced by an unpickler that refuses every global outside a
  short allow-list (an ``UnpicklingError``, raised inside a family: expected). A
  mutated pickle could otherwise name any callable of this process (``os.system``).
  It is the pure-Python unpickler, with pickle's own ways to allocate what a length
  says cut short (see :class:`_RestrictedUnpickler`): pickle's properties, not shoal's.
- shoal's shared-memory directory is a private temporary directory, so that refs in
  ``shoal.same-host``/``shoal.runspec`` headers cannot map, rename or remove a real
  segment of another shoal process of this user.

Run (see fuzz/README.md)::

    python fuzz/fuzz_decode.py -max_total_time=60 fuzz/corpus

The harness adds its seed inputs (valid messages of every kind, made with shoal's own
encoder) to the first corpus directory named on the command line.
"""

from __future__ import annotations

import atexit
import hashlib
import io
import logging
import os
import pickle
import random
import shutil
import struct
import sys
import tempfile
from typing import Any

import atheris

logging.disable(logging.CRITICAL)  # the parser logs every connection it would close

with atheris.instrument_imports(include=["shoal", "msgpack"]):
    import msgpack

    import shoal.comm  # noqa: F401 - registers the shoal.same-host family
    import shoal.taskspec  # noqa: F401 - registers the shoal.runspec family
    from shoal.comm import framing, shm, shm_files
    from shoal.comm.handshake import decode_stranger
    from shoal.errors import ProtocolError
    import shoal.protocol.core  # noqa: F401 - taken from sys.modules below
    import shoal.protocol.serialize  # noqa: F401

# (``shoal.protocol.serialize`` the attribute is the function of that name)
core = sys.modules["shoal.protocol.core"]
serialize = sys.modules["shoal.protocol.serialize"]

# ------------------------------------------------------------------ harm reduction

_SHM_DIR = tempfile.mkdtemp(prefix="shoal-fuzz-shm-")
shm_files.SHM_DIR = _SHM_DIR  # the file rules read it at each use
atexit.register(shutil.rmtree, _SHM_DIR, ignore_errors=True)

_ALLOWED_GLOBALS = {
    ("builtins", name)
    # nothing that allocates what a number says (bytearray(10**9)): pickles may do that
    # by design, and the fuzzer would only find the rss limit
    for name in ("set", "frozenset", "complex", "slice", "dict", "tuple", "int", "float", "str", "bool")
} | {
    ("shoal.taskspec", "Ref"),
    ("shoal.taskspec", "Task"),
    ("shoal.protocol.serialize", "Serialize"),
    ("shoal.protocol.serialize", "Serialized"),
    ("shoal.protocol.serialize", "_rebuild_memoryview"),
    ("copyreg", "_reconstructor"),
}


class _RestrictedUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """The pure-Python unpickler, restricted. Pickle's own ways to allocate what a
    length says are cut short (pickle's, not shoal's; they would stop every run at the
    rss limit): the C unpickler makes its memo as long as the largest index a PUT names
    (a 9-byte pickle, None then LONG_BINPUT 2**25, commits 512 MiB); this one has a
    dict for a memo, and its BYTEARRAY8 allocates the announced length before reading,
    which is refused here when the pickle is shorter."""

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def __init__(self, data: Any, **kwargs: Any):
        self._size = memoryview(data).nbytes
        super().__init__(io.BytesIO(data), **kwargs)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"fuzz harness: global {module}.{name} refused")
        return super().find_class(module, name)

    def _load_bytearray8(self) -> None:
        (n,) = struct.unpack("<Q", self.read(8))
        if n > self._size:
            raise pickle.UnpicklingError(f"fuzz harness: BYTEARRAY8 of {n} bytes in a pickle of {self._size}")
        b = bytearray(n)
        self.readinto(b)
        self.append(b)

    dispatch[pickle.BYTEARRAY8[0]] = _load_bytearray8


def _restricted_loads(data: Any, /, *, fix_imports: bool = True, encoding: str = "ASCII",
                      errors: str = "strict", buffers: Any = ()) -> Any:
    return _RestrictedUnpickler(data, fix_imports=fix_imports, encoding=encoding,
                                errors=errors, buffers=buffers).load()


pickle.loads = _restricted_loads  # type: ignore[assignment]

# ------------------------------------------------------------------ what is expected

_FAMILY_DECODE = serialize.deserialize.__code__


def _inside_a_family(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside a family's decoder (documented: it propagates)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is _FAMILY_DECODE:
            return True
        tb = tb.tb_next
    return False


def _loads(frames: list[Any], deserialize: bool) -> None:
    acks: list[int] = []
    try:
        core.loads(frames, deserialize, acks)
    except ProtocolError:
        pass
    except (RecursionError, MemoryError, SystemError):
        raise  # from anywhere: the interpreter's limits, not a family refusing bytes
    except Exception as exc:
        if not _inside_a_family(exc):
            raise
    if any(type(i) is not int for i in acks):
        raise AssertionError(f"lease ids to acknowledge that are not ints: {acks!r:.200}")


def _stranger(frames: list[Any]) -> bool:
    try:
        msg = decode_stranger(frames)
    except ProtocolError:
        return False
    if not (isinstance(msg, dict) and isinstance(msg.get("op"), str)):
        raise AssertionError(f"decode_stranger returned {msg!r:.200}")
    return True


# ------------------------------------------------------------------ the frame parser


def _feed(data: bytes, seed: int | None, mode: int, decode: bool = True) -> tuple[list[list[bytes]], str]:
    """Feed ``data`` to a fresh FrameProtocol in chunks (sizes drawn from ``seed``;
    None: as much as the parser takes at once). Returns the messages it delivered and
    its error (``""``: none); with ``decode``, authenticated messages go to ``loads``."""
    proto = framing.FrameProtocol()
    if mode == _PARSE:
        proto.set_limits()
    elif mode == _PARSE_SMALL:
        proto.set_limits(16, 4096)
    rng = random.Random(seed)
    top = 1 + ((seed or 0) % 64) * 16
    pos = 0
    strangers = 0
    authenticated = mode != _PARSE_STRANGER
    delivered: list[list[bytes]] = []
    while True:
        while proto.messages:
            frames = proto.messages.popleft()
            delivered.append([bytes(f) for f in frames])
            if not authenticated:
                if not _stranger(frames):
                    return delivered, "refused"  # the handshake refuses and closes
                strangers += 1
                if strangers == framing.HANDSHAKE_MESSAGES:
                    authenticated = True
                    proto.set_limits()  # what run_handshake does once it is done
            elif decode:
                _loads(frames, deserialize=mode == _PARSE_SMALL)
        if proto.error is not None:
            if not isinstance(proto.error, ProtocolError):
                raise AssertionError(f"the parser failed with {proto.error!r}")
            return delivered, f"{type(proto.error).__name__}: {proto.error}"
        if pos >= len(data) or proto._held:
            return delivered, ""
        buf = proto.get_buffer(-1)
        if len(buf) == 0:
            return delivered, ""  # a transport would have paused reading
        n = min(len(buf), len(data) - pos, len(buf) if seed is None else rng.randint(1, top))
        buf[:n] = data[pos : pos + n]
        pos += n
        proto.buffer_updated(n)


def _parse_both_ways(data: bytes, seed: int, mode: int) -> None:
    """The parser must deliver the same messages, and fail the same way, whether the
    bytes come in small pieces or all at once (two code paths: step by step, and whole
    messages out of the scratch buffer)."""
    pieces = _feed(data, seed, mode)
    whole = _feed(data, None, mode, decode=False)
    if pieces != whole:
        raise AssertionError(f"in pieces: {len(pieces[0])} messages, {pieces[1]!r:.200}; "
                             f"at once: {len(whole[0])} messages, {whole[1]!r:.200}")


# ------------------------------------------------------------------ structured messages

#: segment files in the private shared-memory directory that fuzzed refs may name:
#: (name, size, token); put back before every structured input (adopting renames them)
_SEGMENTS = [(f"shoal-{os.getpid()}-fz{i}-00", 8192, f"tok{i}") for i in range(2)] + [("shoal-1-fz2-00", 8192, "tok2")]
_FAMILIES = ["pickle", "bytes", "int", "shoal.same-host", "shoal.runspec", "no-such-family", ""]
_KINDS = ["bytes", "bytearray", "memoryview", "pickle", "other"]
_FORMATS = ["B", "b", "i", "d", "Q", "?", "<i", "xx", "", "P", "e"]


def _put_segments_back() -> None:
    for name, size, token in _SEGMENTS:
        path = os.path.join(_SHM_DIR, name)
        if not os.path.exists(path):
            with open(path, "wb") as f:
                f.write(shm_files.segment_header(token).ljust(size, b"\1"))
    shm.work_off()  # adopted segments given back or removed meanwhile


def _value(fdp: Any, depth: int, n_entries: int) -> Any:
    """A msgpack value of any shape, with tuples, out-of-band references and stray
    extension types."""
    kind = fdp.ConsumeIntInRange(0, 13 if depth < 4 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return fdp.ConsumeBool()
    if kind == 2:
        return fdp.ConsumeIntInRange(-(1 << 63), (1 << 64) - 1)
    if kind == 3:
        return fdp.ConsumeFloat()
    if kind == 4:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 12))
    if kind == 5:
        return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 12))
    if kind == 6:  # an out-of-band reference, in range or not, of any data length
        i = fdp.ConsumeIntInRange(0, n_entries + 1)
        return msgpack.ExtType(2, i.to_bytes(fdp.ConsumeIntInRange(1, 9), "little"))
    if kind == 7:  # another extension type; ext -1 (msgpack's timestamp) included
        if fdp.ConsumeBool():
            return msgpack.Timestamp(fdp.ConsumeIntInRange(-(1 << 40), 1 << 40), fdp.ConsumeIntInRange(0, 999_999_999))
        return msgpack.ExtType(fdp.ConsumeIntInRange(0, 127), fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 5)))
    if kind == 8:
        return fdp.PickValueInList(["op", "key", "keys", "tasks", "payload", "refs", "kind", "int"])
    if kind == 9:  # a tuple (ext 1)
        items = [_value(fdp, depth + 1, n_entries) for _ in range(fdp.ConsumeIntInRange(0, 3))]
        return msgpack.ExtType(1, _packb(items))
    if kind == 10:
        return [_value(fdp, depth + 1, n_entries) for _ in range(fdp.ConsumeIntInRange(0, 4))]
    if kind == 11:  # a tuple nested deeply
        inner: Any = _value(fdp, depth + 1, n_entries)
        for _ in range(fdp.ConsumeIntInRange(1, 40)):
            inner = msgpack.ExtType(1, _packb([inner]))
        return inner
    out = {}
    for _ in range(fdp.ConsumeIntInRange(0, 4)):
        out[_key(fdp, depth, n_entries)] = _value(fdp, depth + 1, n_entries)
    return out


def _key(fdp: Any, depth: int, n_entries: int) -> Any:
    k = _value(fdp, depth + 2, n_entries)
    try:
        hash(k)
    except TypeError:
        return repr(k)[:20]
    return k


def _packb(obj: Any) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True, strict_types=False)
    except (OverflowError, ValueError, TypeError):
        return msgpack.packb(None)


def _ref(fdp: Any) -> Any:
    if fdp.ConsumeIntInRange(0, 3) == 0:
        return None
    name, size, token = fdp.PickValueInList(_SEGMENTS)
    if fdp.ConsumeIntInRange(0, 5) == 0:
        name = fdp.PickValueInList([name + "x", "shoal-", "shoal-../x", "x", "shoal-" + "9" * 300, ""])
    if fdp.ConsumeIntInRange(0, 5) == 0:
        token = fdp.PickValueInList(["tok", token * 20, ""])
    offset = fdp.ConsumeIntInRange(-1, size + 1)
    length = fdp.ConsumeIntInRange(-1, size + 1)
    ref = [name, fdp.ConsumeIntInRange(0, size * 2), offset, length, fdp.ConsumeIntInRange(-1, 2), token]
    if fdp.ConsumeIntInRange(0, 7) == 0:
        ref[fdp.ConsumeIntInRange(0, 5)] = _value(fdp, 3, 0)
    if fdp.ConsumeIntInRange(0, 7) == 0:
        del ref[fdp.ConsumeIntInRange(0, 5):]
    return ref


def _family_header(fdp: Any, family: str) -> Any:
    choice = fdp.ConsumeIntInRange(0, 6)
    if choice == 0:
        return _value(fdp, 2, 0)
    if choice == 1:
        return {"kind": fdp.PickValueInList(_KINDS)}
    if choice == 2:
        shape = [fdp.ConsumeIntInRange(-1, 9) for _ in range(fdp.ConsumeIntInRange(0, 3))]
        return {"kind": "memoryview", "format": fdp.PickValueInList(_FORMATS), "shape": shape}
    if choice == 3:
        digits = fdp.PickValueInList(["1" * fdp.ConsumeIntInRange(0, 4400), "-12", " 7 ", "1_000", "x", ""])
        return {"int": digits if fdp.ConsumeBool() else _value(fdp, 3, 0)}
    if choice == 4:
        return {"refs": [_ref(fdp) for _ in range(fdp.ConsumeIntInRange(0, 3))]}
    if choice == 5:
        return {"refs": _value(fdp, 3, 0)}
    return {}


def _frame(fdp: Any) -> bytes:
    choice = fdp.ConsumeIntInRange(0, 3)
    if choice == 0:
        return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))
    if choice == 1:
        return pickle.dumps(fdp.PickValueInList([1, "s", (1, 2), {3}, bytearray(b"b"), abs, None]), protocol=5)
    if choice == 2:
        return pickle.dumps(((fdp.ConsumeInt(2),), {}), protocol=5)
    return b""


def structured(fdp: Any) -> list[bytes]:
    """The frames of a message built from msgpack values: a header with references,
    a table whose entries have shoal's families and headers, lease ids, opaque or
    not, some of them malformed on purpose."""
    n_entries = fdp.ConsumeIntInRange(0, 4)
    table: list[Any] = []
    frames: list[bytes] = []
    for _ in range(n_entries):
        family = fdp.PickValueInList(_FAMILIES)
        n = fdp.ConsumeIntInRange(0, 3)
        entry: list[Any] = [family, _family_header(fdp, family), n, fdp.ConsumeBool()]
        if fdp.ConsumeBool():
            entry.append([fdp.ConsumeIntInRange(0, 1 << 40) for _ in range(fdp.ConsumeIntInRange(0, 2))])
        if fdp.ConsumeIntInRange(0, 9) == 0:  # malformed on purpose
            entry[fdp.ConsumeIntInRange(0, len(entry) - 1)] = _value(fdp, 2, 0)
        table.append(entry)
        frames.extend(_frame(fdp) for _ in range(n))
    if fdp.ConsumeIntInRange(0, 9) == 0:
        frames.append(b"extra")
    header = _packb(_value(fdp, 0, n_entries))
    if not table:
        return [header]
    return [header, _packb(table), *frames]


# ------------------------------------------------------------------ inputs

_LOADS_PLAIN, _LOADS_DESERIALIZE, _STRANGER, _PARSE_STRANGER, _PARSE, _PARSE_SMALL, _STRUCTURED = range(7)
N_MODES = 7


def split_frames(rest: bytes) -> list[bytes]:
    """``count`` (1 byte, mod 8), then ``count - 1`` frames each as u16 length + bytes;
    the last frame is what is left."""
    if not rest:
        return []
    count, rest = rest[0] % 8, rest[1:]
    frames = []
    for _ in range(max(count - 1, 0)):
        if len(rest) < 2:
            break
        (n,) = struct.unpack_from("<H", rest)
        frames.append(rest[2 : 2 + n])
        rest = rest[2 + n :]
    if count:
        frames.append(rest)
    return frames


def join_frames(frames: list[bytes]) -> bytes:
    """The inverse of :func:`split_frames` (for seeds)."""
    out = bytes([len(frames)])
    for f in frames[:-1]:
        out += struct.pack("<H", len(f)) + f
    return out + (frames[-1] if frames else b"")


#: with SHOAL_FUZZ_FINDINGS=DIR, an unexpected exception is not a crash: the first
#: input of each kind (exception type and where it was raised) is saved in DIR and
#: the fuzzer goes on (a real crash, a hang or running out of memory still stops it)
_FINDINGS = os.environ.get("SHOAL_FUZZ_FINDINGS")
_seen: set[str] = set()


def one_input(data: bytes) -> None:
    if _FINDINGS is None:
        _one_input(data)
        return
    try:
        _one_input(data)
    except Exception as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = f"{os.path.basename(tb.tb_frame.f_code.co_filename)}-{tb.tb_lineno}" if tb else "?"
        kind = f"{type(exc).__name__}-{where}"
        if kind not in _seen:
            _seen.add(kind)
            os.makedirs(_FINDINGS, exist_ok=True)
            with open(os.path.join(_FINDINGS, f"finding-{kind}-{hashlib.sha1(data).hexdigest()[:12]}"), "wb") as f:
                f.write(data)
            print(f"FINDING {kind}: {exc!r:.300}", file=sys.stderr, flush=True)


def _one_input(data: bytes) -> None:
    if not data:
        return
    mode, rest = data[0] % N_MODES, data[1:]
    if mode == _LOADS_PLAIN:
        _loads(split_frames(rest), deserialize=False)
    elif mode == _LOADS_DESERIALIZE:
        _loads(split_frames(rest), deserialize=True)
    elif mode == _STRANGER:
        _stranger([rest])
    elif mode == _STRUCTURED:
        _put_segments_back()
        fdp = atheris.FuzzedDataProvider(rest)
        deserialize = fdp.ConsumeBool()
        _loads(structured(fdp), deserialize)
    else:
        seed, stream = (rest[0], rest[1:]) if rest else (0, b"")
        _parse_both_ways(stream, seed, mode)


# ------------------------------------------------------------------ seeds


def _wire(frames: list[Any]) -> bytes:
    frames = [bytes(f) for f in frames]
    return struct.pack(f"<Q{len(frames)}Q", len(frames), *map(len, frames)) + b"".join(frames)


def seeds() -> list[bytes]:
    """Valid inputs of every kind, made with shoal's own encoder."""
    from shoal.protocol import dumps, to_serialize
    from shoal.protocol.serialize import Serialized
    from shoal.taskspec import Ref, RunSpec

    ext2 = msgpack.ExtType(2, (0).to_bytes(4, "little"))
    messages: list[list[Any]] = [
        dumps({"op": "identity", "reply": True}),
        dumps({"op": "who-has", "keys": [("x", 1), "y", 3]}),
        dumps({"op": "task-finished", "key": ("x", 1), "nbytes": 8, "duration": 0.5}),
        dumps([{"op": "heartbeat"}, {"op": "reschedule", "key": ("a", (1, 2))}]),
        dumps({"op": "update-data", "data": {"k": b"x" * 65_537, ("t", 2): bytearray(b"ab")}}),
        dumps({"big": 1 << 200, "neg": -(1 << 70), 1 << 65: "key"}),
        dumps({"mv": memoryview(b"abcdefgh").cast("i"), "s": to_serialize({1, 2, 3})}),
        dumps({"s": to_serialize({1: frozenset([2])}), "b": memoryview(b"x" * 10)}, "same-host"),
        dumps({"op": "run", "function": to_serialize(len), "args": to_serialize(([1, 2],))}),
        dumps({"op": "update-graph", "tasks": [{"key": "t", "payload": to_serialize(
            RunSpec(abs, (Ref("u"),), {})), "deps": ["u"]}], "wanted": ["t"]}),
        dumps({"e": Serialized("shoal.same-host", {"refs": [None, ["shoal-1-2-ab", 8192, 4096, 16, 1, "tok"]]},
                               [pickle.dumps(1, protocol=5), b"x" * 16])}, "same-host"),
        dumps({"e": Serialized("shoal.runspec", {"refs": [["shoal-1-2-ab", 8192, 4096, 16, 0, "tok"]]},
                               [pickle.dumps(abs), pickle.dumps(((), {}))])}, "same-host"),
        dumps({"e": Serialized("bytes", {"kind": "pickle"}, [pickle.dumps(bytearray(b"zz"))])}),
        dumps({"e": Serialized("no-such-family", {"a": (1, 2)}, [b"?"])}),
        [msgpack.packb({"op": "x", "v": ext2}), msgpack.packb([["int", {"int": "1" * 40}, 0, False, [1, 2]]])],
        [msgpack.packb({"v": ext2}), msgpack.packb([["shoal.same-host", {"refs": [["shoal-9-1-aa", 8192, 4096, 8, 1,
                                                                              "t"]]}, 1, True, [7]]]), b"p"],
        [msgpack.packb({"op": "shoal-lease-ack", "ids": [1, 2, 3]})],
    ]
    stranger = [
        {"op": "handshake", "protocol": 4, "nonce": b"n" * 32, "auth": True},
        {"op": "handshake-auth", "proof": b"p" * 32, "pid": 12, "host": "h/boot",
         "shm_probe": ["shoal-12-probe0-ab", "0" * 32]},
        {"op": "handshake-shm", "can_map": True},
    ]
    out: list[bytes] = []
    for frames in messages:
        if all(len(f) < 1 << 16 for f in frames[:-1]):
            joined = join_frames([bytes(f) for f in frames])
            out.append(bytes([_LOADS_PLAIN]) + joined)
            out.append(bytes([_LOADS_DESERIALIZE]) + joined)
        out.append(bytes([_PARSE, 7]) + _wire(frames))
        out.append(bytes([_PARSE_SMALL, 200]) + _wire(frames) * 2)
    handshake = b"".join(_wire([msgpack.packb(m)]) for m in stranger)
    for m in stranger:
        out.append(bytes([_STRANGER]) + msgpack.packb(m))
    out.append(bytes([_PARSE_STRANGER, 3]) + handshake + b"".join(_wire(f) for f in messages[:4]))
    rng = random.Random(0)
    out.extend(bytes([_STRUCTURED]) + rng.randbytes(rng.randint(20, 400)) for _ in range(50))
    out.append(bytes([_PARSE, 0]) + struct.pack("<QQ", 1, 1 << 17) + b"x" * 100)  # a large frame, cut short
    out.append(bytes([_PARSE, 9]) + struct.pack("<Q", 3) + struct.pack("<3Q", 0, 2, 0) + b"\x90\x90")
    return out


def write_seeds(directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    for data in seeds():
        path = os.path.join(directory, "seed-" + hashlib.sha1(data).hexdigest())
        if not os.path.exists(path):
            with open(path, "wb") as f:
                f.write(data)


def main() -> None:
    corpus = [a for a in sys.argv[1:] if not a.startswith("-")]
    if corpus and not os.path.isfile(corpus[0]):  # not when reproducing one input
        write_seeds(corpus[0])
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
