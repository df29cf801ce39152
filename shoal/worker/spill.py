"""Values on disk: how a worker's store writes a value to a spill file and reads it back.

A value is pickled with protocol 5, its large buffers (numpy arrays, pandas blocks)
taken out of band and written from where they are (``writev``: no copy of a big array
into a bytes object first); what plain pickle refuses (lambdas, local classes) goes
through cloudpickle. A value neither can pickle (a lock, an open file) raises
:class:`Unspillable`. Each frame is lz4-compressed when lz4 is installed and a sample
of it shrinks; a frame that does not shrink is written as it is.

File layout (integers little-endian)::

    magic  b"SHOALSP2"
    u32    number of frames (the pickle stream first, then its buffers)
    per frame: u8 codec (0 raw, 1 lz4 chunks), u64 raw length, u64 stored length,
               u64 xxh3_64 of the frame's stored bytes
    u64    xxh3_64 of everything above (the header's own checksum)
    the frames, one after another; an lz4 frame is a run of chunks, each a u32
    compressed length and the lz4 block of up to :data:`CHUNK` raw bytes

A value whose parts are read one at a time (a shuffle's split: each output partition
reads its own rows) is written in parts (:func:`write_parts`): one such record per
part, one after another, each with its own header and checksums, so that one part
is read and checked alone (:func:`read_part`) without the bytes of the others.

Checksums: a disk (or a program writing where it should not) can change a file's
bytes, and a value read back from such a file must never be used. Each frame's stored
bytes are hashed (xxh3, ~17 GB/s cold, ~30 GB/s in cache): a compressed chunk as it is
written or read (in cache), a large raw frame in a thread of its own while it is written
(no time of its own where a core is free), and read back a piece at a time, each hashed
as it lands; the header is checked before any length in it is believed. A mismatch, a file shorter or longer than its
header says, or a block lz4 cannot decode raise :class:`CorruptSpillFile` (a
:class:`~shoal.errors.CorruptedDataError`) naming the file; the store then treats the
value as lost (:mod:`.store`). Compressed frames are hashed as stored, before they are
decompressed: corrupt input never reaches lz4 unnoticed.

Reading back allocates each buffer once (uninitialized memory where numpy is there)
and reads the file straight into it, so a read-back array is private and writeable.
"""

from __future__ import annotations

import concurrent.futures
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
import xxhash

from ..errors import CorruptedDataError, ShoalError

__all__ = ["Unspillable", "CorruptSpillFile", "lz4_available", "dump_frames", "write_value", "read_value",
           "write_parts", "read_part", "read_parts", "identity"]

MAGIC = b"SHOALSP2"
_COUNT = struct.Struct("<I")
_FRAME = struct.Struct("<BQQQ")
_SUM = struct.Struct("<Q")
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
#: raw frames at least this large are hashed in a thread of their own while they are
#: written (the write lets go of the GIL, and so does xxhash)
_THREAD_HASH = 4 * CHUNK
#: the largest lz4 block a chunk of CHUNK raw bytes compresses to (lz4's bound)
_MAX_BLOCK = CHUNK + CHUNK // 255 + 16


#: errors reading a spill file that may pass (the file is not at fault)
MAY_PASS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


class Unspillable(ShoalError):
    """The value cannot be written to disk: neither pickle nor cloudpickle takes it."""


class CorruptSpillFile(CorruptedDataError):
    """A spill file does not hold what was written to it: its bytes do not match their
    checksums, it is shorter or longer than its header says, or it is no spill file of
    this version. ``key`` and ``path`` name the value and the file where known."""

    def __init__(self, message: str, key: Any = None, path: str | None = None):
        super().__init__(message)
        self.key = key
        self.path = path


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
    written, _ = write_parts(path, [obj], compress)
    return written


def write_parts(path: str, parts: Sequence[Any], compress: bool = True) -> tuple[int, list[tuple[int, int]]]:
    """Write each of ``parts`` to a new file ``path``, one record after another (a
    record is laid out as a file of :func:`write_value`, its own header and checksums
    included); returns the bytes written and each record's ``(offset, length)``, by
    which :func:`read_part` reads one back alone. Raises as :func:`write_value`."""
    framed = [dump_frames(part) for part in parts]
    records: list[tuple[int, int]] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        try:
            pos = 0
            for frames in framed:
                n = _write_record(fd, frames, compress, pos)
                records.append((pos, n))
                pos += n
        finally:
            os.close(fd)
    except BaseException:
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
    return pos, records


def _write_record(fd: int, frames: list[memoryview], compress: bool, start: int) -> int:
    """Write one record of ``frames`` at ``start`` (where ``fd`` stands); returns its
    length."""
    entries: list[tuple[int, int, int, int]] = []
    # small raw frames go out together, in one writev
    pending: list[Any] = [bytes(_header_size(len(frames)))]
    pos = start
    for frame in frames:
        n = frame.nbytes
        if compress and _lz4 is not None and n >= MIN_COMPRESS and _sample_shrinks(frame):
            pos += _writev_all(fd, pending)
            pending = []
            done = _write_compressed(fd, frame)
            if done is not None:
                entries.append((LZ4, n, *done))
                pos += done[0]
                continue
            # it does not shrink after all: written as it is, over the attempt
            os.ftruncate(fd, pos)
            os.lseek(fd, pos, os.SEEK_SET)
        if n < _THREAD_HASH:
            pending.append(frame)
            entries.append((RAW, n, n, xxhash.xxh3_64_intdigest(frame)))
            continue
        pos += _writev_all(fd, pending)
        pending = []
        entries.append((RAW, n, n, _write_raw(fd, frame)))
        pos += n
    pos += _writev_all(fd, pending)
    table = b"".join([MAGIC, _COUNT.pack(len(frames)), *(_FRAME.pack(*e) for e in entries)])
    header = table + _SUM.pack(xxhash.xxh3_64_intdigest(table))
    if os.pwrite(fd, header, start) != len(header):
        raise OSError(errno.EIO, "short write of a spill file's header")
    return pos - start


def _header_size(count: int) -> int:
    return len(MAGIC) + _COUNT.size + count * _FRAME.size + _SUM.size


def _write_raw(fd: int, frame: memoryview) -> int:
    """Write a large ``frame`` as it is, hashed meanwhile in a thread of its own
    (xxhash lets go of the GIL, as does the write): the write takes no longer when a
    core is free. Returns the checksum."""
    digest = _hasher().submit(xxhash.xxh3_64_intdigest, frame)
    try:
        _writev_all(fd, [frame])
    finally:
        checksum: int = digest.result()
    return checksum


_hash_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _hasher() -> concurrent.futures.ThreadPoolExecutor:
    """The thread that hashes large raw frames while they are written."""
    global _hash_pool
    if _hash_pool is None:
        _hash_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shoal-spill-hash")
    return _hash_pool


def _write_compressed(fd: int, frame: memoryview) -> tuple[int, int] | None:
    """Write ``frame`` as lz4 chunks; ``(bytes written, checksum)``, or ``None`` as
    soon as what was compressed so far does not shrink below :data:`RATIO` (the caller
    writes the frame as it is instead)."""
    assert _lz4 is not None
    stored = 0
    h = xxhash.xxh3_64()
    for start in range(0, frame.nbytes, CHUNK):
        piece = frame[start : start + CHUNK]
        block = _lz4.compress(piece, store_size=False)
        prefix = _CHUNK_LEN.pack(len(block))
        h.update(prefix)
        h.update(block)
        stored += _writev_all(fd, [prefix, block])
        if stored > RATIO * (start + piece.nbytes):
            return None
    return stored, h.intdigest()


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
    (the file cannot be opened or read) and :class:`CorruptSpillFile` (its bytes are
    not those written: see the module)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _read_record(fd, path, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What tells one file from another (a path may be reused by the next file):
    its device, inode, modification time (ns) and size."""
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


def read_part(path: str, offset: int, length: int, expect: tuple[int, ...] | None = None) -> Any:
    """The part in the record at ``offset`` (of ``length`` bytes) of a file written
    by :func:`write_parts`, read alone; raises as :func:`read_value`, and
    ``FileNotFoundError`` when ``expect`` is given and the file at ``path`` is not the
    one of that :func:`identity` (another process's file, replaced meanwhile)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if expect is not None and identity(st) != tuple(expect):
            raise FileNotFoundError(f"{path} is no longer the spill file it was")
        size = st.st_size
        if offset < 0 or length < 0 or offset + length > size:
            raise CorruptSpillFile(f"spill file {path} has {size:,} bytes, no record of {length:,} at {offset:,}",
                                   path=path)
        os.lseek(fd, offset, os.SEEK_SET)
        return _read_record(fd, path, offset, length)
    finally:
        os.close(fd)


def read_parts(path: str, records: Sequence[tuple[int, int]]) -> list[Any]:
    """Every part of a file written by :func:`write_parts` (``records`` as it
    returned them); raises as :func:`read_value`."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if sum(n for _, n in records) != size:
            raise CorruptSpillFile(f"spill file {path} has {size:,} bytes, not the {sum(n for _, n in records):,} "
                                   "of its records", path=path)
        out = []
        for offset, length in records:
            os.lseek(fd, offset, os.SEEK_SET)
            out.append(_read_record(fd, path, offset, length))
        return out
    finally:
        os.close(fd)


def _read_record(fd: int, path: str, start: int, size: int) -> Any:
    """The value in the record of ``size`` bytes at ``start`` (where ``fd`` stands)."""
    head = _read_exact(fd, min(len(MAGIC) + _COUNT.size, size), path)
    if head[: len(MAGIC)] != MAGIC or len(head) < len(MAGIC) + _COUNT.size:
        raise CorruptSpillFile(f"{path} is not a spill file (of this version)", path=path)
    (count,) = _COUNT.unpack_from(head, len(MAGIC))
    if _header_size(count) > size:
        raise CorruptSpillFile(f"spill file {path} is cut short (or its header is corrupt): "
                               f"{size:,} bytes for {count:,} frames", path=path)
    table = _read_exact(fd, _header_size(count) - len(head), path)
    (digest,) = _SUM.unpack_from(table, len(table) - _SUM.size)
    if xxhash.xxh3_64_intdigest(bytes(head) + table[: -_SUM.size]) != digest:
        raise CorruptSpillFile(f"the header of spill file {path} does not match its checksum", path=path)
    entries = [_FRAME.unpack_from(table, i * _FRAME.size) for i in range(count)]
    expected = _header_size(count) + sum(e[2] for e in entries)
    if expected != size:
        where = "" if start == 0 else f" (the record at {start:,})"
        raise CorruptSpillFile(f"spill file {path}{where} has {size:,} bytes; its header says {expected:,}",
                               path=path)
    frames = [_read_frame(fd, path, i, *e) for i, e in enumerate(entries)]
    return pickle.loads(frames[0], buffers=frames[1:])


def _read_frame(fd: int, path: str, index: int, codec: int, raw: int, stored: int, digest: int) -> Any:
    h = xxhash.xxh3_64()
    if codec == RAW:
        if stored != raw:
            raise CorruptSpillFile(f"spill file {path}: raw frame {index} stored in {stored:,} bytes, not {raw:,}",
                                   path=path)
        out = _empty(raw)
        dest = memoryview(out).cast("B")
        for start in range(0, raw, CHUNK):
            piece = dest[start : start + CHUNK]
            _readinto(fd, piece, path)
            # here, while it is in cache (a thread that hashed it while the next piece is
            # read gains nothing on a busy host: measured)
            h.update(piece)
        _check(h, digest, path, index, raw)
        return out
    if codec != LZ4 or _lz4 is None:
        raise CorruptSpillFile(f"spill file {path} is compressed with lz4, which is not installed here"
                               if codec == LZ4 else f"unknown codec {codec} in spill file {path}", path=path)
    # chunk by chunk: only one compressed block is in memory besides the value; each
    # is hashed before lz4 sees it, the whole checked before the value is used
    buf: Any = None
    view = None
    left = stored
    for start in range(0, raw, CHUNK):
        prefix = _read_exact(fd, _CHUNK_LEN.size, path)
        (n,) = _CHUNK_LEN.unpack(prefix)
        left -= _CHUNK_LEN.size + n
        if n > _MAX_BLOCK or left < 0:
            raise CorruptSpillFile(f"spill file {path}: frame {index} has a chunk of {n:,} bytes, more than "
                                   "its header or lz4 allows", path=path)
        block = _read_exact(fd, n, path)
        h.update(prefix)
        h.update(block)
        want = min(CHUNK, raw - start)
        try:
            out = _lz4.decompress(block, uncompressed_size=want, return_bytearray=True)
        except _lz4.LZ4BlockError as exc:
            raise CorruptSpillFile(f"spill file {path}: frame {index} does not decompress ({exc})",
                                   path=path) from exc
        if len(out) != want:
            raise CorruptSpillFile(f"spill file {path}: frame {index} decompresses to the wrong size", path=path)
        if raw <= CHUNK:  # the one block is the buffer (writeable, as the value had it)
            buf = out
            break
        if view is None:
            buf = _empty(raw)
            view = memoryview(buf).cast("B")
        view[start : start + want] = out
    if left != 0:
        raise CorruptSpillFile(f"spill file {path}: frame {index} is not the {stored:,} bytes its header says",
                               path=path)
    _check(h, digest, path, index, stored)
    return buf if buf is not None else bytearray()


def _check(h: Any, digest: int, path: str, index: int, nbytes: int) -> None:
    if h.intdigest() != digest:
        raise CorruptSpillFile(f"spill file {path}: frame {index} ({nbytes:,} bytes) does not match its checksum "
                               "(its bytes changed on disk)", path=path)


def _empty(n: int) -> Any:
    """A writeable buffer of ``n`` bytes, left uninitialized where numpy is loaded (the
    read fills it: its pages are touched once, not zeroed first)."""
    np = sys.modules.get("numpy")
    if np is not None:
        return np.empty(n, dtype=np.uint8)
    return bytearray(n)


def _read_exact(fd: int, n: int, path: str) -> bytearray:
    buf = bytearray(n)
    _readinto(fd, memoryview(buf), path)
    return buf


def _readinto(fd: int, view: memoryview, path: str) -> None:
    got = 0
    while got < view.nbytes:
        n = os.readv(fd, [view[got:]])
        if n == 0:
            raise CorruptSpillFile(f"spill file {path} ends {view.nbytes - got:,} bytes early", path=path)
        got += n
