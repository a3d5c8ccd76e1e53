"""distribute/ordered_comm.py and distribute/engines.py: ordered MPI collectives as
TF ops, at any world size, and the agreement before each (core/agreement.py,
core/kinds.py): ranks that call different collectives all raise."""

import re
import time

import numpy as np
import pytest
import tensorflow as tf

from mpi_strategy._src.core import kinds
from mpi_strategy._src.distribute.ordered_comm import OrderedComm
from mpi_strategy.errors import CollectiveMismatchError, CollectiveTimeoutError, MPIStrategyError
from mpi_testing import (
    NATIVE_OP_TYPES,
    RANK,
    SIZE,
    WORLD,
    assert_same_on_all_ranks,
    mpi_calls,
    on_python_engine,
)

pytestmark = pytest.mark.device_agnostic  # OrderedComm alone, no strategy


@pytest.fixture(scope="module", params=["native", "python"])
def mpi(request):
    """An OrderedComm on each engine: the compiled kernels (when built here)
    and the numpy one; every test that takes it runs on both."""
    ordered = OrderedComm(WORLD)
    if request.param == "python":
        return on_python_engine(ordered)
    if "native" not in ordered.engines and SIZE > 1:
        pytest.skip("the native kernels are not in use (MPI_STRATEGY_KERNELS)")
    return ordered


def _raised(in_function, tf_error, ours, match, fn, *args):
    """Calls ``fn(*args)`` and checks the exception class the caller sees
    (the mapping documented in mpi_strategy/errors.py): eager, our own
    ``ours`` (an MPIStrategyError and a ``tf_error``); inside tf.function,
    TensorFlow's ``tf_error`` with our class name and message in its text."""
    with pytest.raises(tf_error, match=match) as info:
        fn(*args)
    error = info.value
    if in_function:
        assert type(error) is tf_error and not isinstance(error, MPIStrategyError), type(error)
        assert f"{ours.__name__}: mpi_strategy: " in error.message, error.message[:500]
    else:
        assert type(error) is ours and isinstance(error, MPIStrategyError), type(error)
    return error


# Data of a few bytes travels inside the agreement message ("carried"); more
# takes its own MPI call ("sent"). Both paths must give the same results.
ROWS = {"carried": 2, "sent": 300}


@pytest.fixture(params=sorted(ROWS))
def rows(request):
    return ROWS[request.param]


class CountingComm:
    """A communicator that counts the MPI calls made on it, by name."""

    def __init__(self, comm):
        self._comm, self.calls = comm, {}

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*args, **kwargs)

        return counted


def test_collectives_run_on_their_own_duplicates_freed_with_the_ordered_comm():
    import gc

    from mpi4py import MPI

    ordered, other = OrderedComm(WORLD, name_missing_ranks=True), OrderedComm(WORLD)
    data, agreed = ordered.comm, ordered.collectives.agreement_comm
    # Same ranks, own matching: the data's, the agreement's (and the
    # announcements', made from the agreement's), none the caller's.
    comms = [data, *ordered.agreement.communicators()]
    assert comms[1] is agreed and len(comms) == (3 if SIZE > 1 else 2)
    for i, comm in enumerate(comms):
        assert MPI.Comm.Compare(comm, WORLD) == MPI.CONGRUENT
        assert MPI.Comm.Compare(other.comm, comm) == MPI.CONGRUENT
        assert all(MPI.Comm.Compare(c, comm) == MPI.CONGRUENT for c in comms[i + 1 :])
    assert float(ordered.allreduce_sum(tf.constant(1.0))) == SIZE
    del ordered, comms
    gc.collect()
    assert data == MPI.COMM_NULL and agreed == MPI.COMM_NULL
    assert float(other.allreduce_sum(tf.constant(2.0))) == 2 * SIZE


@pytest.mark.parametrize("engine", ["native", "python"])
def test_two_ordered_comms_of_one_communicator_never_cross(engine):
    """An MPIStrategy's OrderedComm and hvd.init's, both on COMM_WORLD, called
    from two threads in opposite orders on rank 0 and on the others (MPI
    allows it: they are two communicators). Each agreement must meet its own
    (a shared channel mixes their records: wrong sums or a mismatch)."""
    import threading

    strategy, horovod = (_on_engine(OrderedComm(WORLD), engine) for _ in range(2))
    results, errors = {}, []

    def sum_of(name, ordered, scale):
        try:
            results[name] = float(ordered.allreduce_sum(tf.constant(scale * (RANK + 1.0))))
        except (MPIStrategyError, tf.errors.OpError) as error:  # checked below
            errors.append(error)

    first, then = [("strategy", strategy, 1.0), ("horovod", horovod, 100.0)][:: 1 if RANK else -1]
    threads = [threading.Thread(target=sum_of, args=args, daemon=True) for args in (first, then)]
    threads[0].start()
    time.sleep(0.5)  # the first one is in its agreement (which waits for the others)
    threads[1].start()
    for thread in threads:
        thread.join(timeout=120)
    WORLD.Barrier()
    total = SIZE * (SIZE + 1) / 2
    assert (errors, results) == ([], {"strategy": total, "horovod": 100 * total})


def test_small_collectives_take_one_mpi_call_and_large_ones_two():
    if SIZE == 1:
        pytest.skip("a 1-rank world does not call MPI")
    ordered = on_python_engine(OrderedComm(WORLD))  # (the kernels call MPI from C)
    counting = CountingComm(WORLD)
    ordered.collectives.comm = ordered.agreement._comm = counting
    ordered.allreduce_sum(tf.ones([3]))
    ordered.broadcast(tf.ones([2, 2]))
    ordered.allgather(tf.ones([RANK + 1, 2]))
    assert counting.calls == {"Iallgather": 3}
    ordered.allreduce_sum(tf.ones([1000]))
    ordered.broadcast(tf.ones([1000]))
    ordered.allgather(tf.ones([RANK + 1, 1000]))
    assert counting.calls == {"Iallgather": 6, "Allreduce": 1, "Bcast": 1, "Allgatherv": 1}


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64, tf.int32, tf.int64])
@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
def test_allreduce_sum(mpi, dtype, in_function, rows):
    x = tf.cast(tf.reshape(tf.range(3 * rows), [rows, 3]) * (RANK + 1), dtype)
    fn = tf.function(mpi.allreduce_sum) if in_function else mpi.allreduce_sum
    out = fn(x)
    expected = np.arange(3 * rows).reshape(rows, 3) * sum(r + 1 for r in range(SIZE))
    assert out.dtype == dtype and out.shape == (rows, 3)
    np.testing.assert_array_equal(out.numpy(), expected.astype(dtype.as_numpy_dtype))
    assert_same_on_all_ranks(out.numpy(), "allreduce result")


def test_a_small_float_sum_is_bitwise_the_same_on_every_rank(mpi):
    # Values whose sum depends on the order of addition: every rank must
    # add them in the same order (rank order) and get the same bits.
    x = tf.constant([0.1 * (RANK + 1), 1e8 if RANK == 0 else 1.0, -1e8 if RANK == 1 else 3e-8])
    assert_same_on_all_ranks(mpi.allreduce_sum(x).numpy(), "small float sum")


def test_allreduce_scalar_and_empty(mpi):
    assert mpi.allreduce_sum(tf.constant(2.0)).numpy() == 2.0 * SIZE
    assert mpi.allreduce_sum(tf.zeros([0, 4])).shape == (0, 4)


def test_slots_are_aligned_and_packed_with_zero_padding():
    from mpi_strategy._src.core.buffers import ALIGN_BYTES, BufferPool, pack

    arrays = [
        np.arange(6, dtype=np.float32).reshape(2, 3),
        np.arange(300, dtype=np.float32),
        np.float32(7) * np.ones(()),
        np.zeros((0, 4), np.float32),
        np.arange(17, dtype=np.float32),
    ]
    buffer, views = pack(arrays, BufferPool())
    assert buffer.size == 16 + 304 + 16 + 0 + 17  # each padded to 64 bytes, but the last
    for a, v in zip(arrays, views):
        assert v.shape == a.shape and v.ctypes.data % ALIGN_BYTES == 0
        np.testing.assert_array_equal(v, a)
        assert np.shares_memory(v, buffer) or a.size == 0
    assert buffer.sum() == sum(float(a.sum()) for a in arrays)  # the padding is zero


@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
def test_allreduce_packed_many_shapes(mpi, in_function):
    shapes = [[2, 3], [], [0, 4], [17], [5, 1, 2], [300, 1000]]
    tensors = [tf.fill(s, float(RANK + 1 + i)) for i, s in enumerate(shapes)]
    fn = tf.function(mpi.allreduce_sum_packed) if in_function else mpi.allreduce_sum_packed
    outs = fn(tensors)
    for i, (s, out) in enumerate(zip(shapes, outs)):
        assert out.shape == tuple(s)
        np.testing.assert_array_equal(out.numpy(), np.full(s, sum(r + 1 + i for r in range(SIZE))))


def test_results_are_not_overwritten_by_the_next_call(mpi):
    """Outputs are never overwritten by a later call. On the Python engine they
    are views of pooled buffers (reused only when no tensor views them:
    core/test_buffers.py); the kernels' outputs are TensorFlow's own tensors."""
    n = 1 << 16  # large enough to be pooled, and the pair to reach the kernels unconcatenated

    @tf.function
    def summed(x):
        return [*mpi.allreduce_sum_packed([x, 2 * x]), mpi.allreduce_sum(3 * x)]

    held = [summed(tf.fill([n], float(step))) for step in range(6)]  # more than a pool holds
    for step, outs in enumerate(held):
        for factor, out in zip((1, 2, 3), outs):
            np.testing.assert_array_equal(out.numpy(), np.full([n], factor * step * SIZE))


def test_shapes_that_differ_with_equal_sizes_raise_on_every_rank(mpi):
    if SIZE == 1:
        pytest.skip("needs two ranks to disagree")
    x = tf.zeros([2, 3] if RANK == 0 else [3, 2])
    with pytest.raises(
        CollectiveMismatchError, match="same sizes, but the shapes or the parameters"
    ):
        mpi.allreduce_sum(x)


def test_allreduce_rejects_unsupported_dtype(mpi):
    if SIZE == 1:
        pytest.skip("a 1-rank world does not call MPI")
    with pytest.raises(MPIStrategyError, match=r"cannot reduce dtype\(s\) \['bool'\]"):
        mpi.allreduce_sum(tf.constant([True]))


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float32, tf.int64, tf.bool])
def test_allgather_uneven_rows(mpi, dtype, rows):
    # Rank r contributes (r + 1) x rows rows filled with r.
    x = tf.cast(tf.fill([(RANK + 1) * rows, 2], RANK), dtype)
    out = tf.function(mpi.allgather)(x).numpy()
    expected = np.concatenate([np.full([(r + 1) * rows, 2], r) for r in range(SIZE)])
    np.testing.assert_array_equal(out, expected.astype(dtype.as_numpy_dtype))


def test_allgather_mismatched_rows_raise_on_every_rank(mpi):
    if SIZE == 1:
        pytest.skip("needs two ranks to disagree")
    x = tf.zeros([1, 2 + RANK])
    by_rank = "; ".join(
        f"rank {r}: all_gather of 1 rows of {2 + r} float32 elements" for r in range(SIZE)
    )
    with pytest.raises(CollectiveMismatchError, match=re.escape(by_rank)):
        mpi.allgather(x)


@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
def test_allgather_many_mixed_dtypes_and_rows(mpi, in_function):
    # Rank r sends r + 1 rows of one tensor, 2 r rows of another (none on
    # rank 0), a scalar and a 3-d tensor: all in one call.
    tensors = [
        tf.fill([RANK + 1, 3], float(RANK)),
        tf.range(10 * RANK, 12 * RANK, dtype=tf.int64),
        tf.constant(RANK, tf.int32),
        tf.fill([1, 2, 2], tf.constant(RANK + 0.5, tf.float64)),
    ]
    fn = tf.function(mpi.allgather_many) if in_function else mpi.allgather_many
    out = fn(tensors)
    expected = [
        np.concatenate([np.full([r + 1, 3], r, np.float32) for r in range(SIZE)]),
        np.concatenate([np.arange(10 * r, 12 * r) for r in range(SIZE)]).astype(np.int64),
        np.arange(SIZE, dtype=np.int32),
        np.concatenate([np.full([1, 2, 2], r + 0.5) for r in range(SIZE)]),
    ]
    assert [o.dtype for o in out] == [t.dtype for t in tensors]
    for o, e in zip(out, expected):
        np.testing.assert_array_equal(o.numpy(), e)


@pytest.mark.parametrize("rows", [1, 40])
def test_allgather_many_with_equal_rows_on_every_rank(mpi, rows):
    # The usual case (equal batches): each tensor's pieces sit at the same
    # place in every rank's part; empty and 0-d tensors among them.
    tensors = [
        tf.fill([rows, 3], float(RANK)),
        tf.zeros([0, 2]),
        tf.range(rows, dtype=tf.int64) + 100 * RANK,
        tf.constant(RANK, tf.int8),
        tf.fill([rows, 1, 2], tf.constant(RANK, tf.float64)),
    ]
    out = mpi.allgather_many(tensors)
    expected = [
        np.concatenate([np.full([rows, 3], r, np.float32) for r in range(SIZE)]),
        np.zeros([0, 2], np.float32),
        np.concatenate([np.arange(rows) + 100 * r for r in range(SIZE)]),
        np.arange(SIZE, dtype=np.int8),
        np.concatenate([np.full([rows, 1, 2], r, np.float64) for r in range(SIZE)]),
    ]
    for o, e in zip(out, expected):
        np.testing.assert_array_equal(o.numpy(), e)
        assert o.dtype.as_numpy_dtype == e.dtype


def test_allgather_many_dtype_mismatch_raises_on_every_rank(mpi):
    if SIZE == 1:
        pytest.skip("needs two ranks to disagree")
    dtype = tf.int32 if RANK == 0 else tf.int64
    with pytest.raises(CollectiveMismatchError, match=r"ranks disagree .*all_gather of 2 tensors"):
        mpi.allgather_many([tf.zeros([1, 2]), tf.zeros([3], dtype)])
    assert float(mpi.allreduce_sum(tf.constant(1.0))) == SIZE  # still usable


def test_broadcast_takes_rank0_value(mpi, rows):
    x = tf.fill([rows, 3], float(RANK + 7))
    out = tf.function(mpi.broadcast)(x).numpy()
    np.testing.assert_array_equal(out, np.full([rows, 3], 7.0))


def test_broadcast_size_mismatch_raises_on_every_rank(mpi):
    if SIZE == 1:
        pytest.skip("needs two ranks to disagree")
    with pytest.raises(
        CollectiveMismatchError,
        match=rf"ranks disagree .* rank {RANK}: broadcast of {RANK + 1} float32",
    ):
        mpi.broadcast(tf.zeros([RANK + 1]))


@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
def test_allreduce_shape_mismatch_raises_on_every_rank(mpi, in_function):
    if SIZE == 1:
        pytest.skip("needs two ranks to disagree")
    fn = tf.function(mpi.allreduce_sum) if in_function else mpi.allreduce_sum
    by_rank = "; ".join(f"rank {r}: allreduce of {2 + r} float32 elements" for r in range(SIZE))
    # Eager: CollectiveMismatchError; tf.function: tf.errors.InvalidArgumentError.
    _raised(
        in_function,
        tf.errors.InvalidArgumentError,
        CollectiveMismatchError,
        rf"ranks disagree .*shapes \({2 + RANK},\)\)\. {re.escape(by_rank)}",
        fn,
        tf.zeros([2 + RANK]),
    )
    # The communicator is still usable afterwards.
    assert float(mpi.allreduce_sum(tf.constant(1.0))) == SIZE


def test_dtype_mismatch_raises_on_every_rank(mpi):
    if SIZE == 1:
        pytest.skip("needs two ranks to disagree")
    dtype = tf.float64 if RANK == 0 else tf.float32
    by_rank = "; ".join(
        f"rank {r}: allreduce of 3 {'float64' if r == 0 else 'float32'} elements"
        for r in range(SIZE)
    )
    with pytest.raises(CollectiveMismatchError, match=re.escape(by_rank)):
        mpi.allreduce_sum(tf.zeros([3], dtype))


@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
def test_different_collectives_on_different_ranks_raise_on_every_rank(mpi, in_function):
    """Same bytes, different collectives: MPI alone would mix them up silently."""
    if SIZE == 1:
        pytest.skip("needs two ranks to disagree")

    def step(x):
        return mpi.allreduce_sum(x) if RANK == 0 else mpi.broadcast(x)

    fn = tf.function(step) if in_function else step
    _raised(
        in_function,
        tf.errors.InvalidArgumentError,
        CollectiveMismatchError,
        r"rank 0: allreduce of 4 float32 elements; rank 1: broadcast of 4 "
        r"float32 elements.*running different collectives",
        fn,
        tf.ones([4]),
    )
    assert float(mpi.allreduce_sum(tf.constant(1.0))) == SIZE  # still usable


def _on_engine(ordered, engine):
    """``ordered`` on ``engine``: "native", "python", or "mixed" (odd ranks
    on the numpy engine, even ones on the kernels: both engines meet)."""
    if engine == "python" or (engine == "mixed" and RANK % 2):
        return on_python_engine(ordered)
    if "native" not in ordered.engines and SIZE > 1:
        pytest.skip("the native kernels are not in use (MPI_STRATEGY_KERNELS)")
    return ordered


@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
def test_collectives_with_a_timeout_wait_for_late_ranks(in_function):
    """The polled path: ranks arrive at different times, within the timeout;
    even ranks poll in the kernels, odd ones in Python."""
    mpi = _on_engine(OrderedComm(WORLD.Dup(), name_missing_ranks=True), "mixed")

    def step(x):
        x = _rank_dependent_delay(x, 0.3 * RANK)
        summed = mpi.allreduce_sum(x, timeout=60)
        gathered = mpi.allgather(x[: RANK + 1], timeout=60)
        split, _ = mpi.alltoallv(tf.tile(x[:1], [SIZE]), [1] * SIZE, timeout=60)
        mpi.barrier(timeout=60)
        return summed, gathered, mpi.broadcast(x, timeout=60), split

    fn = tf.function(step) if in_function else step
    for _ in range(2):
        summed, gathered, broadcast, split = fn(tf.fill([5], float(RANK + 1)))
        np.testing.assert_array_equal(summed.numpy(), np.full([5], SIZE * (SIZE + 1) / 2))
        np.testing.assert_array_equal(
            gathered.numpy(), np.concatenate([np.full([r + 1], r + 1.0) for r in range(SIZE)])
        )
        np.testing.assert_array_equal(broadcast.numpy(), np.ones([5]))
        np.testing.assert_array_equal(split.numpy(), np.arange(1.0, SIZE + 1))
    if in_function and SIZE > 1:  # (the timed collectives ran on this rank's engine)
        types = {op.type for _, op in mpi_calls(fn.get_concrete_function(tf.ones([5])).graph)}
        assert ("MpiStrategyAllreduce" in types) == (RANK % 2 == 0), types


@pytest.mark.parametrize("engine", ["native", "python"])
@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
def test_a_timeout_is_deadline_exceeded_in_eager_and_unknown_in_a_function(in_function, engine):
    """Rank 0 enters a collective that the other ranks never reach."""
    if SIZE == 1:
        pytest.skip("needs a rank that does not come")
    comm = WORLD.Dup()  # unusable after the timeout: a communicator of its own
    mpi = _on_engine(OrderedComm(comm), engine)

    def step(x):
        return mpi.allreduce_sum(x, timeout=0.5)

    fn = tf.function(step) if in_function else step
    try:
        if RANK == 0:
            # Eager: CollectiveTimeoutError; tf.function: tf.errors.UnknownError.
            _raised(
                in_function,
                tf.errors.UnknownError if in_function else tf.errors.DeadlineExceededError,
                CollectiveTimeoutError,
                r"timeout after 0.5 s on rank 0 in allreduce of 4 float32 elements "
                r"\(shapes \(4,\); collective #1 of this communicator\): some ranks "
                r"never reached it",
                fn,
                tf.ones([4]),
            )
            assert not mpi.agreement.usable
    finally:
        WORLD.Barrier()  # rank 0 has timed out
        if RANK != 0:
            # Complete rank 0's pending signature exchange (not the data that
            # would follow; on the agreement's own communicator), so that no
            # request is left pending, while rank 0 waits in the barrier
            # below, which progresses it.
            mpi.agreement.agree(kinds.ALLREDUCE, np.float32, [(4,)], timeout=60)
        WORLD.Barrier()
        comm.Free()


@pytest.mark.parametrize("engine", ["native", "python", "mixed"])
def test_a_timeout_names_the_ranks_that_never_arrived_on_both_engines(engine):
    """Rank 0 gives up on collective #2; the others entered #1 only. Mixed:
    the announcements cross between the engines."""
    if SIZE == 1:
        pytest.skip("needs a rank that does not come")
    comm = WORLD.Dup()  # unusable after the timeout: a communicator of its own
    mpi = _on_engine(OrderedComm(comm, name_missing_ranks=True), engine)

    def allgather(timeout):
        return tf.function(lambda: mpi.allgather(tf.ones([RANK + 1, 2]), timeout=timeout))

    # Only the collective that rank 0 gives up on has the short timeout: a rank
    # still tracing on a loaded machine must not time out the others.
    patient, step = allgather(60), allgather(0.5)
    patient()  # collective #1, on every rank
    others = list(range(1, SIZE))
    try:
        if RANK == 0:
            _raised(
                True,
                tf.errors.UnknownError,
                CollectiveTimeoutError,
                re.escape(
                    "timeout after 0.5 s on rank 0 in all_gather of 1 rows of 2 float32 "
                    "elements (shapes (2,); collective #2 of this communicator): "
                    f"rank(s) {others} never reached it (the last collective they entered: "
                    + ", ".join(f"rank {r}: #1" for r in others)
                    + ")."
                ),
                step,
            )
    finally:
        WORLD.Barrier()  # rank 0 has timed out
        if RANK != 0:  # (completes rank 0's pending exchange; the data is carried)
            patient()
        WORLD.Barrier()
        comm.Free()


def _rank_dependent_delay(x, seconds):
    """Identity that is slow on some ranks, to provoke reordering of unordered
    ops; the shape stays known (else the kernels would not run what follows)."""

    def sleep(v):
        time.sleep(seconds)
        return v

    return tf.ensure_shape(tf.numpy_function(sleep, [x], x.dtype, stateful=False), x.shape)


def _kernels_everywhere(concrete):
    """How many native kernels ``concrete`` holds, in its branches, loop
    bodies and nested functions too."""
    graph_def = concrete.graph.as_graph_def()
    nodes = [*graph_def.node, *(n for f in graph_def.library.function for n in f.node_def)]
    return sum(n.op in NATIVE_OP_TYPES for n in nodes)


def test_order_is_kept_across_cond_while_and_nested_functions(mpi):
    """Collectives of different sizes in independent conds/loops/functions.

    Nothing but the ordering token links these branches: each reads a
    variable of its own (as a model's step reads its weights), so TensorFlow's
    automatic control dependencies do not chain them (branches that capture no
    resource would be chained as stateful ops, token or not). Each input is
    delayed differently on each rank, so without ordering the ranks would
    issue the collectives in different orders (deadlock, "Message truncated",
    or wrong sums).
    """
    sizes = [1, 1000, 7, 50000, 3, 20000]
    ones = [tf.Variable(1.0) for _ in sizes]

    @tf.function
    def nested(x, one):
        return mpi.allreduce_sum(x * one)

    @tf.function
    def step(flag):
        outs = []
        for i, (n, one) in enumerate(zip(sizes, ones)):
            delay = 0.02 * ((i + RANK) % 3)
            x = _rank_dependent_delay(tf.fill([n], float(i + 1)), delay)
            if i % 3 == 0:
                out = tf.cond(flag, lambda x=x, one=one: mpi.allreduce_sum(x * one), lambda x=x: x)
            elif i % 3 == 1:
                out = tf.while_loop(
                    lambda k, v: k < 2,
                    lambda k, v, one=one: (k + 1, mpi.allreduce_sum(v * one) / SIZE),
                    (tf.constant(0), x),
                )[1]
            else:
                out = nested(x, one)
            outs.append(out)
        return outs

    kernels = _kernels_everywhere(step.get_concrete_function(tf.constant(True)))
    assert kernels == (len(sizes) if mpi.engines[0] == "native" else 0), kernels
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
            summed = tf.cond(
                value >= 0,
                lambda: mpi.allreduce_sum(tf.fill([300], value)),
                lambda: tf.zeros([300]),
            )
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
