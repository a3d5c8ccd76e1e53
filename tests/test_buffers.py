"""mpi_strategy.buffers: aligned result buffers, reused only once nothing views them."""

import numpy as np

from mpi_strategy.buffers import ALIGN_BYTES, BufferPool, aligned_empty

BIG = 1 << 15  # float32 elements: 128 KiB, pooled


def test_buffers_are_aligned_for_tensorflow():
    pool = BufferPool()
    for count in (1, 3, 17, BIG, BIG + 1):
        assert pool.empty(count, np.float32).ctypes.data % ALIGN_BYTES == 0
    for shape in [(), (0, 3), (5, 7), (3, 1, 2)]:
        fresh = aligned_empty(shape, np.float64)
        assert fresh.shape == shape
        assert fresh.size == 0 or fresh.ctypes.data % ALIGN_BYTES == 0  # empty: no data


def test_a_buffer_is_reused_only_after_every_view_is_gone():
    pool = BufferPool()
    first = pool.empty(BIG, np.float32)
    address = first.ctypes.data
    view = first[10:20]
    del first
    second = pool.empty(BIG, np.float32)  # `view` still holds the first buffer
    assert second.ctypes.data != address
    del view
    third = pool.empty(BIG, np.float32)
    assert third.ctypes.data == address
    assert pool.empty(BIG // 2, np.float32).ctypes.data not in (address, second.ctypes.data)


def test_small_buffers_are_not_pooled():
    pool = BufferPool()
    pool.empty(10, np.float32)
    assert pool._raw == []
