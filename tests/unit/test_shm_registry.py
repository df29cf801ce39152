"""The segment registry: each step of a segment's life, the steps its table refuses,
and :meth:`~shoal.comm.shm_registry.SegmentRegistry.validate` finding what is wrong."""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Iterator

import pytest

from shoal.comm import shm_files
from shoal.comm.shm_registry import TRANSITIONS, SegmentRegistry, SegmentState
from shoal.statelog import InvalidTransition

CREATED, PUBLISHED, LEASED, ADOPTED, POOLED, GIVEN_BACK, UNLINKED = SegmentState
SIZE = 1 << 16


@pytest.fixture
def reg() -> Iterator[SegmentRegistry]:
    """A registry of its own (the process's one is left alone), emptied at the end."""
    r = SegmentRegistry()
    yield r
    r.unlink_all()
    assert not r.owned()


def exists(name: str) -> bool:
    return os.path.exists(shm_files.segment_path(name))


def created(reg: SegmentRegistry, size: int = SIZE) -> str:
    """A new segment of ``size`` bytes, written (a value's header), its lock released."""
    name = shm_files.new_name("test")
    fd = reg.create(name)
    try:
        os.posix_fallocate(fd, 0, size)
        shm_files.pwrite_all(fd, shm_files.segment_header("0" * 16), 0)
    finally:
        os.close(fd)
    assert reg.state(name) is CREATED
    return name


def published(reg: SegmentRegistry, size: int = SIZE) -> str:
    name = created(reg, size)
    reg.publish(name, shm_files.owner_mapping(name, size))
    return name


def pooled(reg: SegmentRegistry, size: int = SIZE) -> str:
    reg.retire(published(reg, size), size)
    ((_, name),) = reg.pooled()
    return name


def test_the_table_has_one_state_after_each_step_and_none_after_a_final_one() -> None:
    reached = {after for after in TRANSITIONS.values()}
    assert reached == set(SegmentState)  # every state is reached by some step
    for (before, step), after in TRANSITIONS.items():
        assert before not in (GIVEN_BACK, UNLINKED), f"{step} out of the final state {before}"
    steps = {step for _, step in TRANSITIONS}
    assert steps == {"create", "reuse", "publish", "lease", "adopt", "retire", "reclaim", "give_back", "unlink"}
    for step in steps:  # the docstring draws every step
        assert step in (SegmentRegistry.__doc__ or ""), step


def test_create_publish_retire_reuse(reg: SegmentRegistry) -> None:
    name = published(reg)
    assert reg.state(name) is PUBLISHED and reg.has_writer(name)
    reg.validate()
    reg.retire(name, SIZE)
    # the name is gone at once; the segment waits in the pool under a pool name
    assert reg.state(name) is None and not exists(name)
    ((size, pool_name),) = reg.pooled()
    assert size == SIZE and reg.state(pool_name) is POOLED and exists(pool_name)
    assert reg.has_writer(pool_name)  # its pages stay mapped for the reuse
    reg.validate()
    got = reg.reuse(SIZE - 100)
    assert got is not None
    new, fd, size, writer = got
    try:
        assert reg.state(new) is CREATED and reg.state(pool_name) is None and not reg.pooled()
        assert size == SIZE and writer is not None and not exists(pool_name)
    finally:
        os.close(fd)
    reg.publish(new, writer)
    reg.validate()
    reg.unlink(new)
    assert reg.state(new) is None and not exists(new) and not reg.has_writer(new)
    reg.validate()


def test_reuse_takes_only_a_fitting_segment_nobody_maps(reg: SegmentRegistry) -> None:
    big = 4 << 20
    for wrong in (big + 1, big // 4):  # too small; far too large for what is asked
        name = pooled(reg, big)
        assert reg.reuse(wrong) is None
        assert not reg.pooled() and not exists(name)  # its room went with the miss
        reg.validate()
    name = pooled(reg, big)
    fd, _ = shm_files.open_segment(name, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)  # a reader maps it
    try:
        assert reg.reuse(big) is None  # not taken from under its reader...
        assert not reg.pooled() and not exists(name)  # ...and its name went with the miss
        assert os.pread(fd, 8, 0) == shm_files.segment_header("0" * 16)[:8]  # the reader still reads it
        reg.validate()
    finally:
        os.close(fd)
    name = pooled(reg, big)
    got = reg.reuse(big // 2)
    assert got is not None and got[2] == big and not reg.pooled()
    os.close(got[1])
    reg.unlink(got[0])


def test_lease_then_unlink(reg: SegmentRegistry) -> None:
    name = created(reg)
    reg.lease(name)
    assert reg.state(name) is LEASED
    os.unlink(shm_files.segment_path(name))  # the receiver took it
    reg.validate()  # a leased segment's file may be gone
    reg.unlink(name)  # the lease ends
    assert reg.state(name) is None


def test_adopt_then_give_back_or_retire(reg: SegmentRegistry) -> None:
    theirs = created(reg)  # as another process's transfer would be
    reg.lease(theirs)
    mine = reg.adopt(theirs)
    assert reg.state(mine) is ADOPTED and not exists(theirs) and exists(mine)
    reg.unlink(theirs)  # the sender's lease ends: nothing to remove
    reg.validate()
    assert reg.give_back(mine, 999_999_999)
    assert reg.state(mine) is None and not exists(mine)
    (returned,) = shm_files.segments_of(999_999_999)
    assert returned.startswith("shoal-999999999-ret")
    os.unlink(shm_files.segment_path(returned))
    # another one is retired into the pool instead
    other = created(reg)
    reg.lease(other)
    kept = reg.adopt(other)
    reg.unlink(other)
    reg.retire(kept, SIZE)
    assert [s for s, _ in reg.pooled()] == [SIZE] and reg.state(kept) is None
    reg.validate()
    assert not reg.give_back("shoal-1-not-held", 1)  # nothing to give back


def test_reclaim_takes_a_returned_segment_into_the_pool_or_removes_it(reg: SegmentRegistry) -> None:
    for room in (True, False):
        reg.pool_limit = SIZE if room else SIZE - 1
        ret = shm_files.new_name("ret")
        with open(shm_files.segment_path(ret), "xb") as f:
            f.truncate(SIZE)
        assert reg.reclaim(ret, SIZE)
        assert not exists(ret) and reg.state(ret) is None
        assert len(reg.pooled()) == (1 if room else 0)
        reg.validate()
        reg.drain_pool()


def test_the_pool_keeps_no_more_than_its_limit(reg: SegmentRegistry) -> None:
    reg.pool_limit = SIZE
    first, second = published(reg), published(reg)
    reg.retire(first, SIZE)
    reg.retire(second, SIZE)  # no room: unlinked
    assert len(reg.pooled()) == 1 and not exists(second) and reg.state(second) is None
    reg.validate()


def test_trim_pool_unlinks_what_waited_too_long(reg: SegmentRegistry) -> None:
    now = [0.0]
    reg.clock = lambda: now[0]
    old = pooled(reg)
    now[0] = 50.0
    reg.retire(published(reg), SIZE)
    assert reg.trim_pool(30.0) == 1 and reg.state(old) is None and not exists(old)
    assert len(reg.pooled()) == 1
    reg.drain_pool()
    assert not reg.pooled() and not reg.owned()
    reg.validate()


def test_a_miss_takes_its_room_out_of_the_pool_oldest_first(reg: SegmentRegistry) -> None:
    """What the pool holds and fits no request goes as new memory is taken elsewhere:
    the pool never makes the process larger than the most it held."""
    now = [0.0]
    reg.clock = lambda: now[0]
    names = []
    for at in (0.0, 1.0, 2.0):
        now[0] = at
        reg.retire(published(reg), SIZE)
        names.append(reg.pooled()[-1][1])
    oldest, middle, newest = names
    # a miss of more than one segment but less than two: the two oldest go
    assert reg.reuse(SIZE * 3 // 2) is None
    assert reg.state(oldest) is None and not exists(oldest)
    assert reg.state(middle) is None and not exists(middle)
    assert [name for _, name in reg.pooled()] == [newest]
    reg.validate()
    # a hit takes nothing more out of the pool than the segment it reuses
    got = reg.reuse(SIZE // 2)
    assert got is not None
    name, fd, size, writer = got
    os.close(fd)
    assert size == SIZE and not reg.pooled()
    reg.validate()
    assert reg.reuse(SIZE) is None  # an empty pool: nothing to give back


@pytest.mark.parametrize("state", [PUBLISHED, LEASED, POOLED, None])
def test_an_illegal_step_raises_and_changes_nothing(reg: SegmentRegistry, state: SegmentState | None) -> None:
    if state is None:
        name = shm_files.new_name("test")
    elif state is POOLED:
        name = pooled(reg)
    else:
        name = created(reg)
        if state is PUBLISHED:
            reg.publish(name)
        else:
            reg.lease(name)
    before = (reg.state(name), reg.pooled(), reg.owned())
    for step in (reg.publish, reg.lease):
        with pytest.raises(InvalidTransition, match="cannot"):
            step(name)
    if state is not None:
        with pytest.raises(InvalidTransition, match=f"cannot give back segment {name}"):
            reg.give_back(name, 1)
    if state in (LEASED, POOLED):
        with pytest.raises(InvalidTransition, match="cannot retire"):
            reg.retire(name, SIZE)
    assert (reg.state(name), reg.pooled(), reg.owned()) == before
    reg.validate()


def test_a_name_is_created_once(reg: SegmentRegistry) -> None:
    name = created(reg)
    with pytest.raises(FileExistsError):
        reg.create(name)
    assert reg.state(name) is CREATED


def test_validate_finds_a_file_gone_behind_its_back(reg: SegmentRegistry) -> None:
    name = published(reg)
    os.unlink(shm_files.segment_path(name))
    with pytest.raises(AssertionError, match=f"{name} is published but its file is gone"):
        reg.validate()
    reg.unlink(name)
    reg.validate()


def test_validate_finds_a_file_that_is_no_segment_of_ours(reg: SegmentRegistry, tmp_path) -> None:
    name = pooled(reg)
    path = shm_files.segment_path(name)
    os.unlink(path)
    os.symlink(tmp_path, path)  # something else under a pooled segment's name
    with pytest.raises(AssertionError, match=f"{name} is pooled but its file is gone or no segment of ours"):
        reg.validate()
    reg.drain_pool()
    assert not os.path.lexists(path)


def test_validate_finds_a_pool_beyond_its_limit(reg: SegmentRegistry) -> None:
    pooled(reg)
    reg.pool_limit = SIZE - 1
    with pytest.raises(AssertionError, match="beyond its limit"):
        reg.validate()
    reg.drain_pool()
    reg.validate()


def test_a_mapping_is_found_and_forgotten_when_it_dies(reg: SegmentRegistry) -> None:
    import gc

    name = published(reg)
    fd, _ = shm_files.open_segment(name, os.O_RDONLY)
    m = mmap.mmap(fd, SIZE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    os.close(fd)
    reg.remember_mapping(name, m, "0" * 16, SIZE, lambda _: reg.forget_mapping(name))
    assert reg.mapping(name, "0" * 16) is m and reg.mapping(name, "f" * 16) is None
    view = memoryview(m)
    assert reg.locate(view[100:200]) == (name, SIZE, 100, 100, "0" * 16)
    view.release()
    del m
    gc.collect()
    assert reg.mapping(name, "0" * 16) is None and reg.locate(memoryview(b"x" * 10)) is None
    reg.validate()


def test_forget_parent_holds_nothing(reg: SegmentRegistry) -> None:
    names = [published(reg), pooled(reg)]
    reg.adopt_transfers = True
    reg.forget_parent()  # what a forked child does
    assert not reg.owned() and not reg.pooled() and not reg.adopt_transfers
    reg.validate()
    assert all(exists(n) for n in names)  # the files are left to their owner
    reg.unlink_all()
    assert all(exists(n) for n in names)
    for n in names:
        os.unlink(shm_files.segment_path(n))
