"""Values on disk: how a worker's store writes a value to a spill file and reads it back.

A value is pickled with protocol 5, its large buffers (numpy arrays, pandas blocks)
taken out of band and written from where they are (``writev``: no copy of a big array
into a bytes object first); what plain pickle refuses (lambdas, local classes) goes
through cloudpickle. A value neither can pickle (a lock, an open file) raises
:class:`Unspillable`. Each frame is lz4-compressed when lz4 is installed and a sample
of it shrinks; a frame that does not shrink is written as it is.

File layout (integers little-endian)::

    magic  b"SHOALSP1"
    u32    number of frames (the pickle stream first, then its buffers)
    per frame: u8 codec (0 raw, 1 lz4 chunks), u64 raw length, u64 stored length
    the frames, one after another; an lz4 frame is a run of chunks, each a u32
    compressed length and the lz4 block of up to :data:`CHUNK` raw bytes

Reading back allocates each buffer once (uninitialized memory where numpy is there)
and reads the file straight into it, so a read-back array is private and writeable.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import struct
import sys
from collections import ChainMap
from collections.abc import Sequence
from typing import Any

import cloudpickle

from ..errors import ShoalError

__all__ = ["Unspillable", "CorruptSpillFile", "lz4_available", "dump_frames", "write_value", "read_value"]

MAGIC = b"SHOALSP1"
_COUNT = struct.Struct("<I")
_FRAME = struct.Struct("<BQQ")
_CHUNK_LEN = struct.Struct("<I")
RAW, LZ4 = 0, 1
#: raw bytes per lz4 block: small enough that the temporary block of compressing or
#: decompressing comes from the allocator's heap, warm, instead of fresh pages (3x
#: faster to read back than 16 MiB blocks), large enough to cost few calls
CHUNK = 1 << 20
#: frames smaller than this are written as they are (compressing costs more than it saves)
MIN_COMPRESS = 1 << 12
#: a frame is compressed only if its sample (and then the whole) shrinks below this ratio
RATIO = 0.9
_SAMPLE_PIECE = 1 << 14
#: buffers per writev call (the system's IOV_MAX is 1024)
_IOV = 512


class Unspillable(ShoalError):
    """The value cannot be written to disk: neither pickle nor cloudpickle takes it."""


class CorruptSpillFile(ShoalError):
    """A spill file is shorter than its header says, or not a spill file at all."""


try:
    import lz4.block as _lz4
except ImportError:  # lz4 is optional (the ``spill`` extra): frames are written raw
    _lz4 = None


def lz4_available() -> bool:
    """Whether lz4 is installed (spill files are compressed then)."""
    return _lz4 is not None


def dump_frames(obj: Any) -> list[memoryview]:
    """``obj`` as its pickle stream followed by its out-of-band buffers (views of the
    object's own memory, not copies). Raises :class:`Unspillable` when neither pickle
    nor cloudpickle can pickle it (the cause attached)."""
    try:
        return _dump(pickle.dumps, obj)
    except KeyboardInterrupt:
        raise
    except BaseException as first:  # noqa: BLE001 - a __reduce__ may raise anything
        try:
            return _dump(_cloudpickle_dumps, obj)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - as above
            raise Unspillable(f"cannot pickle a {type(obj).__name__}: {exc!r:.300}") from first


def _refuse(obj: Any) -> Any:
    raise TypeError(f"a {type(obj).__name__} is not written to disk")


class _CloudPickler(cloudpickle.Pickler):
    """cloudpickle, less its pickling of open text files by their contents: read
    back, that would be another object (a StringIO), not the value stored."""

    dispatch_table = ChainMap({io.TextIOWrapper: _refuse}, cloudpickle.Pickler.dispatch_table)


def _cloudpickle_dumps(obj: Any, protocol: int, buffer_callback: Any) -> bytes:
    f = io.BytesIO()
    _CloudPickler(f, protocol=protocol, buffer_callback=buffer_callback).dump(obj)
    return f.getvalue()


def _dump(dumps: Any, obj: Any) -> list[memoryview]:
    buffers: list[pickle.PickleBuffer] = []
    stream = dumps(obj, protocol=5, buffer_callback=buffers.append)
    frames = [memoryview(stream)]
    for b in buffers:
        try:
            frames.append(b.raw())
        except BufferError:  # not contiguous: one copy of it
            frames.append(memoryview(bytes(memoryview(b))))
    return frames


def _sample_shrinks(frame: memoryview) -> bool:
    """Whether pieces from the start, middle and end of ``frame`` compress below
    :data:`RATIO` (random data is told at the cost of 48 KiB, not the whole frame)."""
    assert _lz4 is not None
    n = frame.nbytes
    if n <= 3 * _SAMPLE_PIECE:
        sample = frame.tobytes()
    else:
        mid = n // 2
        sample = b"".join(frame[a : a + _SAMPLE_PIECE].tobytes() for a in (0, mid, n - _SAMPLE_PIECE))
    return len(_lz4.compress(sample, store_size=False)) < RATIO * len(sample)


def write_value(path: str, obj: Any, compress: bool = True) -> int:
    """Write ``obj`` to a new file ``path``; returns the bytes written. Raises
    :class:`Unspillable` (nothing is written then) and ``OSError`` (disk full, say:
    the partial file is removed first); ``FileExistsError`` if ``path`` exists.

    Frames are written as they are compressed, one chunk at a time, and the header
    last, in the room left for it: a spill costs one compressed chunk of memory, not
    a compressed copy of the value (spilling happens when memory is short)."""
    frames = dump_frames(obj)
    entries: list[tuple[int, int, int]] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        try:
            # small raw frames go out together, in one writev
            pending: list[Any] = [bytes(len(MAGIC) + _COUNT.size + len(frames) * _FRAME.size)]
            pos = 0
            for frame in frames:
                n = frame.nbytes
                if compress and _lz4 is not None and n >= MIN_COMPRESS and _sample_shrinks(frame):
                    pos += _writev_all(fd, pending)
                    pending = []
                    stored = _write_compressed(fd, frame)
                    if stored is not None:
                        entries.append((LZ4, n, stored))
                        pos += stored
                        continue
                    # it does not shrink after all: written as it is, over the attempt
                    os.ftruncate(fd, pos)
                    os.lseek(fd, pos, os.SEEK_SET)
                pending.append(frame)
                entries.append((RAW, n, n))
            pos += _writev_all(fd, pending)
            header = b"".join([MAGIC, _COUNT.pack(len(frames)), *(_FRAME.pack(*e) for e in entries)])
            if os.pwrite(fd, header, 0) != len(header):
                raise OSError(errno.EIO, f"short write of a spill file's header ({path})")
        finally:
            os.close(fd)
    except BaseException:
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
    return pos


def _write_compressed(fd: int, frame: memoryview) -> int | None:
    """Write ``frame`` as lz4 chunks; the bytes written, or ``None`` as soon as what
    was compressed so far does not shrink below :data:`RATIO` (the caller writes the
    frame as it is instead)."""
    assert _lz4 is not None
    stored = 0
    for start in range(0, frame.nbytes, CHUNK):
        piece = frame[start : start + CHUNK]
        block = _lz4.compress(piece, store_size=False)
        stored += _writev_all(fd, [_CHUNK_LEN.pack(len(block)), block])
        if stored > RATIO * (start + piece.nbytes):
            return None
    return stored


def _writev_all(fd: int, pieces: Sequence[Any]) -> int:
    """Write every piece in order, resuming after short writes; returns the total."""
    views = [memoryview(p).cast("B") for p in pieces]
    total = sum(v.nbytes for v in views)
    i = 0
    while i < len(views):
        batch = views[i : i + _IOV]
        written = os.writev(fd, batch)
        # skip the pieces written whole, and cut the one written in part
        for v in batch:
            if written >= v.nbytes:
                written -= v.nbytes
                i += 1
            else:
                views[i] = v[written:]
                break
    return total


def read_value(path: str) -> Any:
    """The value in spill file ``path`` (the file is left as it is). Raises ``OSError``
    and :class:`CorruptSpillFile`."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        head = _read_exact(fd, len(MAGIC) + _COUNT.size)
        if head[: len(MAGIC)] != MAGIC:
            raise CorruptSpillFile(f"{path} is not a spill file")
        (count,) = _COUNT.unpack_from(head, len(MAGIC))
        table = _read_exact(fd, count * _FRAME.size)
        frames = [_read_frame(fd, *_FRAME.unpack_from(table, i * _FRAME.size)) for i in range(count)]
    finally:
        os.close(fd)
    return pickle.loads(frames[0], buffers=frames[1:])


def _read_frame(fd: int, codec: int, raw: int, stored: int) -> Any:
    if codec == RAW:
        out = _empty(raw)
        _readinto(fd, memoryview(out).cast("B"))
        return out
    if codec != LZ4 or _lz4 is None:
        raise CorruptSpillFile("a spill file compressed with lz4, which is not installed here"
                               if codec == LZ4 else f"unknown codec {codec} in a spill file")
    # chunk by chunk: only one compressed block is in memory besides the value
    buf: Any = None
    view = None
    for start in range(0, raw, CHUNK):
        (n,) = _CHUNK_LEN.unpack(_read_exact(fd, _CHUNK_LEN.size))
        if raw <= CHUNK:  # the one block is the buffer (writeable, as the value had it)
            return _lz4.decompress(_read_exact(fd, n), uncompressed_size=raw, return_bytearray=True)
        block = _lz4.decompress(_read_exact(fd, n), uncompressed_size=min(CHUNK, raw - start))
        if view is None:
            buf = _empty(raw)
            view = memoryview(buf).cast("B")
        view[start : start + len(block)] = block
    return buf if buf is not None else bytearray()


def _empty(n: int) -> Any:
    """A writeable buffer of ``n`` bytes, left uninitialized where numpy is loaded (the
    read fills it: its pages are touched once, not zeroed first)."""
    np = sys.modules.get("numpy")
    if np is not None:
        return np.empty(n, dtype=np.uint8)
    return bytearray(n)


def _read_exact(fd: int, n: int) -> bytearray:
    buf = bytearray(n)
    _readinto(fd, memoryview(buf))
    return buf


def _readinto(fd: int, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        n = os.readv(fd, [view[got:]])
        if n == 0:
            raise CorruptSpillFile(f"a spill file ends {view.nbytes - got} bytes early")
        got += n
