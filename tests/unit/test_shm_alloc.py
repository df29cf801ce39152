"""Arrays born in shared memory: a task thread's large numpy allocations come from the
pool of retired segments, and publishing such an array as a value copies nothing."""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from shoal import _shmalloc
from shoal.comm import shm, shm_born, shm_files

MB = 1 << 20


@pytest.fixture(autouse=True)
def clean_pool():
    shm.drain_pool()
    assert shm_born.enable_array_allocator(MB), "the C helper shoal._shmalloc is not built"
    yield
    gc.collect()
    shm.work_off()
    shm.drain_pool()
    assert not shm.segments_of(os.getpid()), "a test left segments in /dev/shm"
    assert _shmalloc.live() == 0


def in_task_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a thread using the allocator, as a worker's task thread does."""
    out: dict[str, Any] = {}

    def main() -> None:
        shm_born.use_array_allocator()
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            out["error"] = exc

    t = threading.Thread(target=main)
    t.start()
    t.join(30)
    if "error" in out:
        raise out["error"]
    return out["value"]


def pooled_segment(nbytes: int) -> None:
    """Leave one retired segment that fits an array of ``nbytes`` in the pool."""
    seg, value = shm.place(np.zeros(nbytes // 8))
    del value
    gc.collect()
    seg.retire()
    assert len(shm.registry.pooled()) == 1


def data_address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_a_large_array_is_born_in_a_pooled_segment_and_published_without_a_copy():
    pooled_segment(8 * MB)
    ((size, pooled),) = shm.registry.pooled()

    def task() -> Any:
        a = np.full(MB, 7.0)  # 8 MB: takes the pooled segment
        assert len(shm.registry.born_arrays()) == 1 and not shm.registry.pooled()
        seg, local = shm.place(a)
        # the value is the born array's segment, its data where numpy wrote it
        assert seg.size == size and seg.info[3] == [[shm_files.DATA_OFFSET, 8 * MB]]
        return seg, local

    seg, local = in_task_thread(task)
    try:
        gc.collect()
        assert np.array_equal(local, np.full(MB, 7.0)) and local.flags.writeable
        assert np.array_equal(shm.attach(seg.info), local)  # what a same-host peer maps
    finally:
        del local
        gc.collect()
        seg.retire()
    # the task's own array is gone and nobody maps the value: the segment is reusable
    assert [s for s, _ in shm.registry.pooled()] == [size]


def test_a_result_of_views_of_one_buffer_is_born_in_a_new_segment_and_published_without_a_copy():
    before = dict(shm.placements)

    def task() -> Any:
        with shm_born.for_result():  # (the pool is empty: a new segment)
            whole = np.empty(3 * MB, dtype=np.uint8)
        ints, floats = whole[:MB].view(np.int64), whole[2 * MB :].view(np.float64)
        ints[:] = np.arange(MB // 8)
        floats[:] = 0.5
        small = np.arange(10)  # (elsewhere, small: copied in front with the pickle stream)
        return shm.place((ints, floats, small))

    seg, local = in_task_thread(task)
    try:
        assert shm.placements["born"] == before["born"] + 1 and shm.placements["copied"] == before["copied"]
        layout = seg.info[3]
        assert layout[0] == [shm_files.DATA_OFFSET, MB] and layout[1] == [shm_files.DATA_OFFSET + 2 * MB, MB]
        assert layout[2][0] + layout[2][1] <= shm_files.DATA_OFFSET
        ints, floats, small = local
        assert np.array_equal(ints, np.arange(MB // 8)) and (floats == 0.5).all()
        assert np.array_equal(small, np.arange(10))
        again = shm.attach(seg.info)  # as a peer maps it
        assert np.array_equal(again[0], ints) and np.array_equal(again[2], small)
        del again
    finally:
        del local
        gc.collect()
        seg.unlink()


def test_buffers_elsewhere_too_large_to_go_in_front_mean_a_copy():
    before = dict(shm.placements)

    def task() -> Any:
        with shm_born.for_result():
            whole = np.zeros(2 * MB, dtype=np.uint8)
        return shm.place((whole, np.ones(1024)))  # 8 KiB elsewhere: no room in front

    seg, local = in_task_thread(task)
    try:
        assert shm.placements["copied"] == before["copied"] + 1 and shm.placements["born"] == before["born"]
        assert not local[0].any() and (local[1] == 1).all()
    finally:
        del local
        gc.collect()
        seg.unlink()


def test_for_result_in_a_thread_without_the_allocator_allocates_as_usual():
    with shm_born.for_result():
        a = np.zeros(4 * MB, dtype=np.uint8)
    assert not shm.registry.born_arrays() and _shmalloc.live() == 0
    del a


def test_small_arrays_and_an_empty_pool_allocate_as_usual():
    def task() -> Any:
        small = np.ones(1000)
        big = np.ones(2 * MB)  # nothing pooled: numpy's own memory
        assert not shm.registry.born_arrays()
        seg, local = shm.place(big)
        assert seg.info[3][0][0] == shm_files.DATA_OFFSET  # copied in
        return small.sum(), seg

    total, seg = in_task_thread(task)
    assert total == 1000.0
    seg.unlink()


def test_temporaries_go_back_to_the_pool_and_zeroed_memory_is_zero():
    pooled_segment(4 * MB)

    def task() -> float:
        a = np.full(MB // 2, 3.0)  # born in the pooled segment (old zeros overwritten)
        assert len(shm.registry.born_arrays()) == 1
        del a
        z = np.zeros(MB // 2)  # the same memory again, now holding 3.0s: zeroed for us
        assert len(shm.registry.born_arrays()) == 1
        return float(np.abs(z).sum())

    assert in_task_thread(task) == 0.0
    gc.collect()
    shm.work_off()
    assert len(shm.registry.pooled()) == 1 and not shm.registry.born_arrays()


def test_realloc_of_a_born_array_keeps_its_contents():
    pooled_segment(2 * MB)

    def task() -> Any:
        a = np.arange(MB // 8, dtype=np.float64)  # 1 MB, born
        assert len(shm.registry.born_arrays()) == 1
        a.resize(2 * MB // 8, refcheck=False)  # numpy reallocs the data
        return a

    a = in_task_thread(task)
    assert np.array_equal(a[: MB // 8], np.arange(MB // 8)) and (a[MB // 8 :] == 0).all()
    del a


def test_a_value_released_while_its_array_lives_is_not_reused_until_the_array_dies():
    pooled_segment(8 * MB)
    kept: list[np.ndarray] = []

    def task() -> Any:
        a = np.full(MB, 2.0)
        kept.append(a)  # user code keeps the array past the task
        return shm.place(a)

    seg, local = in_task_thread(task)
    del local
    gc.collect()
    seg.retire()  # the key is released: its name goes at once
    assert not os.path.exists(os.path.join(shm.SHM_DIR, seg.name))
    assert not shm.registry.pooled()  # but its memory is still the user's array
    assert kept[0].sum() == 2.0 * MB
    kept.clear()
    gc.collect()
    shm.work_off()
    assert not shm.registry.born_arrays() and not shm.registry.has_writer(seg.name)


def test_threads_without_the_allocator_are_untouched():
    pooled_segment(8 * MB)
    a = np.full(MB, 1.0)  # the test's own thread did not install it
    assert not shm.registry.born_arrays() and len(shm.registry.pooled()) == 1
    del a


def _received(buf: np.ndarray, like: np.ndarray) -> Any:
    """The value a receiver rebuilds from a pickle stream and one frame: ``buf``."""
    import pickle

    frames: list[pickle.PickleBuffer] = []
    data = pickle.dumps(like, protocol=5, buffer_callback=frames.append)
    buf[:] = np.frombuffer(frames[0].raw(), dtype=np.uint8)
    return pickle.loads(data, buffers=[buf])


def test_a_frame_landed_in_a_pooled_segment_is_kept_for_the_host_without_a_copy():
    pooled_segment(8 * MB)
    ((size, _),) = shm.registry.pooled()
    sent = np.arange(MB, dtype=np.float64)  # 8 MB
    buf = shm_born.land(sent.nbytes)
    assert buf is not None and buf.flags.writeable and not shm.registry.pooled()
    value = _received(buf, sent)
    assert data_address(value) == data_address(buf)
    del buf
    born = shm.placements["born"]
    seg, local = shm.place(value)  # what a worker does to keep a value for its host
    try:
        assert shm.placements["born"] == born + 1  # published where it landed: no copy
        assert seg.size == size and seg.info[3] == [[shm_files.DATA_OFFSET, sent.nbytes]]
        del value
        gc.collect()
        assert np.array_equal(local, sent) and np.array_equal(shm.attach(seg.info), sent)
        shm.registry.validate()
    finally:
        del local
        gc.collect()
        seg.retire()
    shm.work_off()
    assert [s for s, _ in shm.registry.pooled()] == [size]


def test_a_landed_frame_that_is_not_kept_goes_back_to_the_pool():
    pooled_segment(4 * MB)
    buf = shm_born.land(4 * MB)
    assert buf is not None and len(shm.registry.born_arrays()) == 1
    value = _received(buf, np.ones(MB // 2))
    del buf
    assert float(value.sum()) == MB // 2
    del value
    gc.collect()
    shm.work_off()
    assert len(shm.registry.pooled()) == 1 and not shm.registry.born_arrays()
    shm.registry.validate()


def test_no_pooled_segment_that_fits_means_no_landing():
    assert shm_born.land(2 * MB) is None  # an empty pool
    pooled_segment(2 * MB)
    assert shm_born.land(64 * MB) is None  # too small for the frame
    assert not shm.registry.pooled()  # the frame takes its memory elsewhere: the pool gave up as much
