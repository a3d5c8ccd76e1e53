"""core/buffers.py: aligned result buffers, reused only once nothing views them.

The pool must neither reuse a buffer that some array still views (results
would be overwritten: the tests with ``held``/``holder``) nor stop reusing
buffers in steady state (the pool would be pointless: ``..._steady_state``).
"""

import ctypes

import numpy as np
import pytest
import tensorflow as tf

from mpi_strategy._src.core.buffers import ALIGN_BYTES, BufferPool, aligned_empty, pack
from mpi_testing import SIZE, WORLD

pytestmark = pytest.mark.device_agnostic  # buffers alone, no strategy

BIG = 1 << 15  # float32 elements: 128 KiB, pooled


def _pooled(pool, address):
    """Whether ``address`` lies in one of ``pool``'s pooled buffers."""
    starts = [np.frombuffer(slot.memory, np.uint8).ctypes.data for slot in pool._slots]
    return any(start <= address < start + slot.size for start, slot in zip(starts, pool._slots))


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


class _Subclass(np.ndarray):
    pass


# Ways an array (or another object) can keep viewing a handed-out buffer after
# the handed-out array itself is gone. numpy points a view of a view at the
# array that owns the memory, not at the view it was cut from.
HOLDERS = {
    "slice": lambda a: a[10:20],
    "view of a view": lambda a: a[5:][5:20][::2],
    "reshape": lambda a: a.reshape(-1, 8),
    "view as another dtype": lambda a: a.view(np.int32),
    "subclass view": lambda a: a.view(_Subclass),
    "memoryview": memoryview,
    "np.frombuffer": lambda a: np.frombuffer(a, np.float32),
    "np.asarray of a memoryview": lambda a: np.asarray(memoryview(a)),
    "ctypes": lambda a: (ctypes.c_float * a.size).from_buffer(a),
}


@pytest.mark.parametrize("holder", HOLDERS, ids=list(HOLDERS))
def test_whatever_still_views_a_buffer_keeps_it_from_reuse(holder):
    pool = BufferPool()
    first = pool.empty(BIG, np.float32)
    first[...] = 1
    address = first.ctypes.data
    held = HOLDERS[holder](first)
    before = np.array(held)  # a copy
    del first
    second = pool.empty(BIG, np.float32)
    second[...] = 2  # must not land in `held`
    np.testing.assert_array_equal(np.asarray(held), before)
    assert second.ctypes.data != address
    del second, held
    assert pool.empty(BIG, np.float32).ctypes.data == address  # then it is free again


def test_small_buffers_are_not_pooled():
    pool = BufferPool()
    pool.empty(10, np.float32)
    assert pool._slots == []


def _packing_function(pool, addresses):
    """A graph function returning ``x`` and ``2 * x`` as views of ``pool``'s
    buffers, as ``OrderedComm`` does; ``addresses`` gets each buffer's address."""

    def numpy_fn(a, b):
        buffer, views = pack([a, b], pool)
        addresses.append(buffer.ctypes.data)
        return views

    @tf.function
    def packed(x):
        return tf.numpy_function(numpy_fn, [x, 2 * x], [tf.float32, tf.float32])

    return packed


def test_tensorflow_adopts_the_buffers_without_a_copy():
    # What makes reuse dangerous, so that the tests around this one can fail:
    # a result tensor *is* the pool's memory.
    kept = []

    def numpy_fn(a):
        views = pack([a], BufferPool())[1]
        kept.append(views[0])
        return views

    (out,) = tf.function(lambda x: tf.numpy_function(numpy_fn, [x], [tf.float32]))(tf.ones([BIG]))
    kept[0][:] = 7
    np.testing.assert_array_equal(out.numpy(), np.full([BIG], 7, np.float32))


def test_tensorflow_results_are_not_overwritten_and_buffers_are_reused_in_steady_state():
    pool, addresses = BufferPool(), []
    packed = _packing_function(pool, addresses)
    held = [packed(tf.fill([BIG], float(step))) for step in range(4)]
    for step, (once, twice) in enumerate(held):
        np.testing.assert_array_equal(once.numpy(), np.full([BIG], step, np.float32))
        np.testing.assert_array_equal(twice.numpy(), np.full([BIG], 2 * step, np.float32))
    assert len(set(addresses)) == 4
    del held, once, twice

    # Steady state: each step's results are dropped during the next step.
    addresses.clear()
    for step in range(10):
        out = packed(tf.fill([BIG], float(step)))
        np.testing.assert_array_equal(out[1].numpy(), np.full([BIG], 2 * step, np.float32))
    assert all(_pooled(pool, a) for a in addresses), "steady state must use pooled memory"
    assert len(set(addresses)) <= 2, addresses  # this step's buffer and the last one's


@pytest.mark.skipif(SIZE == 1, reason="a 1-rank world does not call MPI")
def test_allreduce_reuses_its_buffers_in_steady_state():
    # The pool is the Python engine's (the native kernels' results are
    # TensorFlow's own tensors): forced here, whichever engine is in use.
    from mpi_strategy._src.distribute.ordered_comm import OrderedComm
    from mpi_testing import on_python_engine

    mpi = on_python_engine(OrderedComm(WORLD))
    pool = mpi.collectives._pool
    summed = tf.function(lambda x: mpi.allreduce_sum_packed([x, 2 * x]))
    for step in range(10):
        out = summed(tf.fill([BIG], float(step)))
        np.testing.assert_array_equal(out[1].numpy(), np.full([BIG], 2 * step * SIZE))
    assert 1 <= len(pool._slots) <= 2, pool._slots  # this step's buffer and the last one's
