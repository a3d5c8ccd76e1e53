"""mpi_strategy.mpi_ops: ordered MPI collectives as TF ops, at any world size."""

import re
import time

import numpy as np
import pytest
import tensorflow as tf

from mpi_testing import RANK, SIZE, WORLD, assert_same_on_all_ranks
from mpi_strategy.errors import MPIStrategyError
from mpi_strategy.mpi_ops import OrderedComm


@pytest.fixture(scope="module")
def mpi():
    return OrderedComm(WORLD)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64, tf.int32, tf.int64])
@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
def test_allreduce_sum(mpi, dtype, in_function):
    x = tf.cast(tf.reshape(tf.range(6), [2, 3]) * (RANK + 1), dtype)
    fn = tf.function(mpi.allreduce_sum) if in_function else mpi.allreduce_sum
    out = fn(x)
    expected = np.arange(6).reshape(2, 3) * sum(r + 1 for r in range(SIZE))
    assert out.dtype == dtype and out.shape == (2, 3)
    np.testing.assert_array_equal(out.numpy(), expected.astype(dtype.as_numpy_dtype))


def test_allreduce_scalar_and_empty(mpi):
    assert mpi.allreduce_sum(tf.constant(2.0)).numpy() == 2.0 * SIZE
    assert mpi.allreduce_sum(tf.zeros([0, 4])).shape == (0, 4)


def test_allreduce_rejects_unsupported_dtype(mpi):
    if SIZE == 1:
        pytest.skip("a 1-rank world does not call MPI")
    with pytest.raises(MPIStrategyError, match="cannot sum dtype bool"):
        mpi.allreduce_sum(tf.constant([True]))


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float32, tf.int64, tf.bool])
def test_allgather_uneven_rows(mpi, dtype):
    # Rank r contributes r + 1 rows filled with r.
    x = tf.cast(tf.fill([RANK + 1, 2], RANK), dtype)
    out = tf.function(mpi.allgather)(x).numpy()
    expected = np.concatenate([np.full([r + 1, 2], r) for r in range(SIZE)])
    np.testing.assert_array_equal(out, expected.astype(dtype.as_numpy_dtype))


def test_allgather_mismatched_rows_raise_on_every_rank(mpi):
    if SIZE == 1:
        pytest.skip("needs two ranks to disagree")
    x = tf.zeros([1, 2 + RANK])
    with pytest.raises((MPIStrategyError, tf.errors.OpError), match="rows of different sizes"):
        mpi.allgather(x)


def test_broadcast_takes_rank0_value(mpi):
    x = tf.fill([3], float(RANK + 7))
    out = tf.function(mpi.broadcast)(x).numpy()
    np.testing.assert_array_equal(out, [7.0, 7.0, 7.0])


def test_broadcast_size_mismatch_raises_on_every_rank(mpi):
    if SIZE == 1:
        pytest.skip("needs two ranks to disagree")
    with pytest.raises((MPIStrategyError, tf.errors.OpError),
                       match=r"ranks disagree .* broadcast of \d+ bytes"):
        mpi.broadcast(tf.zeros([RANK + 1]))


@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
def test_allreduce_shape_mismatch_raises_on_every_rank(mpi, in_function):
    if SIZE == 1:
        pytest.skip("needs two ranks to disagree")
    fn = tf.function(mpi.allreduce_sum) if in_function else mpi.allreduce_sum
    expected = [2 + r for r in range(SIZE)]
    with pytest.raises((MPIStrategyError, tf.errors.OpError),
                       match=rf"allreduce of {2 + RANK} elements .* by rank: {re.escape(str(expected))}"):
        fn(tf.zeros([2 + RANK]))
    # The communicator is still usable afterwards.
    assert float(mpi.allreduce_sum(tf.constant(1.0))) == SIZE


def _rank_dependent_delay(x, seconds):
    """Identity that is slow on some ranks, to provoke reordering of unordered ops."""
    def sleep(v):
        time.sleep(seconds)
        return v
    return tf.numpy_function(sleep, [x], x.dtype, stateful=False)


def test_order_is_kept_across_cond_while_and_nested_functions(mpi):
    """Collectives of different sizes in independent conds/loops/functions.

    Nothing but the ordering token links these branches; each input is delayed
    differently on each rank, so without ordering the ranks would issue the
    collectives in different orders (deadlock, "Message truncated", or wrong
    sums).
    """
    sizes = [1, 1000, 7, 50000, 3, 20000]

    @tf.function
    def nested(x):
        return mpi.allreduce_sum(x)

    @tf.function
    def step(flag):
        outs = []
        for i, n in enumerate(sizes):
            delay = 0.02 * ((i + RANK) % 3)
            x = _rank_dependent_delay(tf.fill([n], float(i + 1)), delay)
            if i % 3 == 0:
                out = tf.cond(flag, lambda x=x: mpi.allreduce_sum(x), lambda x=x: x)
            elif i % 3 == 1:
                out = tf.while_loop(lambda k, v: k < 2,
                                    lambda k, v: (k + 1, mpi.allreduce_sum(v) / SIZE),
                                    (tf.constant(0), x))[1]
            else:
                out = nested(x)
            outs.append(out)
        return outs

    for _ in range(3):
        outs = step(tf.constant(True))
        for i, (n, out) in enumerate(zip(sizes, outs)):
            expected = (i + 1) * (SIZE if i % 3 != 1 else 1)
            np.testing.assert_allclose(out.numpy(), np.full([n], float(expected)))


def test_order_holds_under_keras_style_steps_per_execution(mpi):
    """A while loop whose body has a cond around the step and one around the input."""
    data = iter(tf.data.Dataset.range(100).map(lambda i: tf.cast(i, tf.float32)))

    @tf.function
    def multi_step(iterator):
        def body(k, acc):
            opt = iterator.get_next_as_optional()
            value = tf.cond(opt.has_value(), lambda: opt.get_value(), lambda: 0.0)
            summed = tf.cond(value >= 0, lambda: mpi.allreduce_sum(tf.fill([300], value)),
                             lambda: tf.zeros([300]))
            return k + 1, acc + mpi.allreduce_sum(summed[:1])[0]
        return tf.while_loop(lambda k, acc: k < 5, body, (0, 0.0))[1]

    total = multi_step(data).numpy()
    assert total == sum(range(5)) * SIZE * SIZE
    assert_same_on_all_ranks(total)


def test_xla_is_rejected_with_an_explanation(mpi):
    @tf.function(jit_compile=True)
    def compiled(x):
        return mpi.allreduce_sum(x * 2)

    # TF re-raises errors from tracing as its StagingError, keeping our message.
    with pytest.raises(Exception, match="MPI collective allreduce cannot be compiled by XLA"):
        compiled(tf.ones([2]))
