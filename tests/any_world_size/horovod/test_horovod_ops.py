"""Horovod's TensorFlow collectives (mpi_strategy.horovod.tensorflow), at any world size:
horovod/mpi_ops.py, api.py, functions.py, gradients.py, basics.py (process sets).

Every rank's input is a known function of its rank, so each result is
checked against numpy on every rank: eager, inside tf.function, and in a
TensorFlow 1 graph run by a Session (Horovod's own tests run both).
"""

import numpy as np
import pytest
import tensorflow as tf

import mpi_strategy.horovod.tensorflow as hvd
from mpi_strategy import timeline
from mpi_strategy._src.core import timeline as timeline_lib
from mpi_testing import RANK, SIZE, assert_same_on_all_ranks

pytestmark = pytest.mark.device_agnostic  # Horovod's API: one process per rank, no strategy

hvd.init()

MODES = ["eager", "function", "graph_v1"]


def run(mode, build):
    """``build()`` (which makes Horovod calls) evaluated to numpy in ``mode``."""
    if mode == "eager":
        return tf.nest.map_structure(np.asarray, build())
    if mode == "function":
        return tf.nest.map_structure(np.asarray, tf.function(build)())
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        return session.run(build())


def inputs(shape, dtype, rank):
    """Rank ``rank``'s input: small values, so every reduction is exact."""
    values = (np.arange(np.prod(shape)).reshape(shape) % 5) + rank + 1
    return values.astype(dtype)


EVERY_RANK = [inputs((6, 3), np.float32, r) for r in range(SIZE)]
REDUCTIONS = {
    hvd.Sum: lambda xs: np.sum(xs, axis=0),
    hvd.Average: lambda xs: np.sum(xs, axis=0) / SIZE,
    hvd.Min: lambda xs: np.min(xs, axis=0),
    hvd.Max: lambda xs: np.max(xs, axis=0),
    hvd.Product: lambda xs: np.prod(xs, axis=0),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", sorted(REDUCTIONS), ids=lambda op: f"op{op}")
@pytest.mark.parametrize("rows", [2, 400], ids=["carried", "sent"])
def test_allreduce_ops(mode, op, rows):
    mine = inputs((rows, 3), np.float64, RANK)
    expected = REDUCTIONS[op]([inputs((rows, 3), np.float64, r) for r in range(SIZE)])
    out = run(mode, lambda: hvd.allreduce(tf.constant(mine), op=op))
    np.testing.assert_allclose(out, expected, rtol=1e-12)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int32, np.int64, np.float16])
def test_allreduce_dtypes_sum_and_average(dtype):
    xs = [inputs((17,), dtype, r) for r in range(SIZE)]
    summed = hvd.allreduce(tf.constant(xs[RANK]), op=hvd.Sum)
    averaged = hvd.allreduce(tf.constant(xs[RANK]))  # Horovod's default op
    assert summed.dtype == averaged.dtype == tf.as_dtype(dtype)
    np.testing.assert_array_equal(summed, np.sum(xs, axis=0, dtype=dtype))
    expected = (np.sum(xs, axis=0, dtype=np.float64) / SIZE).astype(dtype)
    np.testing.assert_allclose(averaged.numpy().astype(np.float64), expected, rtol=1e-3)


def test_prescale_and_postscale_apply_before_and_after_the_sum():
    x = tf.constant(EVERY_RANK[RANK])
    out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    np.testing.assert_allclose(out, 1.5 * np.sum(EVERY_RANK, axis=0), rtol=1e-6)
    ints = hvd.allreduce(tf.constant([10, 7]), op=hvd.Sum, prescale_factor=0.5)
    np.testing.assert_array_equal(ints, [5 * SIZE, 3 * SIZE])  # truncated per rank, as Horovod


@pytest.mark.parametrize("mode", MODES)
def test_grouped_allreduce_mixed_dtypes_and_indexed_slices(mode):
    def build():
        dense = [tf.constant(EVERY_RANK[RANK]), tf.constant([RANK + 1], tf.int64)]
        slices = tf.IndexedSlices(tf.ones([1, 3]) * (RANK + 1), tf.constant([RANK]), [SIZE, 3])
        out = hvd.grouped_allreduce([*dense, slices], op=hvd.Sum)
        return out[0], out[1], tf.convert_to_tensor(out[2])

    floats, ints, sparse = run(mode, build)
    np.testing.assert_allclose(floats, np.sum(EVERY_RANK, axis=0))
    np.testing.assert_array_equal(ints, [SIZE * (SIZE + 1) // 2])
    np.testing.assert_array_equal(sparse, np.arange(1, SIZE + 1)[:, None] * np.ones((1, 3)))


@pytest.mark.parametrize("mode", MODES)
def test_allgather_uneven_rows(mode):
    out = run(mode, lambda: hvd.allgather(tf.fill([RANK + 1, 2], RANK)))
    np.testing.assert_array_equal(
        out, np.repeat(np.arange(SIZE), np.arange(1, SIZE + 1))[:, None] * [1, 1]
    )


def test_allgather_gradient_is_this_ranks_rows_of_the_averaged_gradient():
    x = tf.Variable(tf.ones([RANK + 1, 2]))
    with tf.GradientTape() as tape:
        gathered = hvd.allgather(x)
        weights = tf.cast(tf.range(tf.shape(gathered)[0]), tf.float32)[:, None]
        loss = tf.reduce_sum(gathered * weights)
    grad = tape.gradient(loss, x).numpy()
    start = RANK * (RANK + 1) // 2
    np.testing.assert_array_equal(grad[:, 0], np.arange(start, start + RANK + 1))


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_from_every_root(mode):
    for root in range(SIZE):
        out = run(mode, lambda root=root: hvd.broadcast(tf.constant(EVERY_RANK[RANK]), root))
        np.testing.assert_array_equal(out, EVERY_RANK[root])


def test_broadcast_gradient_is_the_average_on_the_root_and_zero_elsewhere():
    x = tf.Variable(tf.ones([3]))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(hvd.broadcast(x, 0) * (RANK + 1))
    expected = (SIZE + 1) / 2 if RANK == 0 else 0
    np.testing.assert_allclose(tape.gradient(loss, x), [expected] * 3)


def test_broadcast_variables_in_place():
    variables = [tf.Variable(tf.fill([4], float(RANK))), tf.Variable(RANK, dtype=tf.int64)]
    hvd.broadcast_variables(variables, root_rank=SIZE - 1)
    np.testing.assert_array_equal(variables[0], [SIZE - 1] * 4)
    assert int(variables[1].numpy()) == SIZE - 1


@pytest.mark.parametrize("mode", MODES)
def test_alltoall_with_splits_returns_received_splits(mode):
    # rank r sends r + 1 rows to every rank: rank d receives r + 1 rows from each r.
    def build():
        rows = tf.fill([(RANK + 1) * SIZE, 2], float(RANK))
        return hvd.alltoall(rows, splits=[RANK + 1] * SIZE)

    out, received = run(mode, build)
    np.testing.assert_array_equal(received, np.arange(1, SIZE + 1))
    np.testing.assert_array_equal(out[:, 0], np.repeat(np.arange(SIZE), np.arange(1, SIZE + 1)))


def test_alltoall_equal_split_and_its_gradient():
    x = tf.Variable(tf.reshape(tf.range(2 * SIZE, dtype=tf.float32), [2 * SIZE, 1]) + 100 * RANK)
    with tf.GradientTape() as tape:
        out = hvd.alltoall(x)
        loss = tf.reduce_sum(out * tf.cast(tf.range(2 * SIZE)[:, None] + 1, tf.float32))
    expected = [100 * r + 2 * RANK + i for r in range(SIZE) for i in range(2)]
    np.testing.assert_array_equal(out[:, 0], expected)
    # Row k of x went to rank k // 2, position 2 * RANK + k % 2 there.
    grad = tape.gradient(loss, x).numpy()[:, 0]
    np.testing.assert_array_equal(grad, [2 * RANK + k % 2 + 1 for k in range(2 * SIZE)])


def test_alltoall_bad_length_is_invalid_argument_on_every_rank():
    if SIZE == 1:
        pytest.skip("every length is a multiple of one rank")
    with pytest.raises(tf.errors.InvalidArgumentError, match="multiple"):
        hvd.alltoall(tf.ones([SIZE + 1]))


@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average])
@pytest.mark.parametrize("rows", [2 * SIZE, 2 * SIZE + 1], ids=["even", "uneven"])
def test_reducescatter_gives_each_rank_its_rows(op, rows):
    xs = [inputs((rows, 2), np.float32, r) for r in range(SIZE)]
    out = hvd.reducescatter(tf.constant(xs[RANK]), op=op)
    counts = [rows // SIZE + (r < rows % SIZE) for r in range(SIZE)]
    start = sum(counts[:RANK])
    np.testing.assert_allclose(out, REDUCTIONS[op](xs)[start : start + counts[RANK]], rtol=1e-6)


def test_reducescatter_of_a_scalar_is_refused():
    with pytest.raises(ValueError, match="scalar"):
        hvd.reducescatter(tf.constant(1.0))


def test_objects():
    assert hvd.broadcast_object({"from": RANK}, root_rank=SIZE - 1) == {"from": SIZE - 1}
    assert hvd.allgather_object({"r": RANK} if RANK % 2 else [RANK]) == [
        {"r": r} if r % 2 else [r] for r in range(SIZE)
    ]


def test_process_set_of_the_even_ranks():
    if SIZE == 1:
        with pytest.raises(ValueError, match="same ranks"):  # as Horovod: no duplicate sets
            hvd.add_process_set([0])
        return
    evens = hvd.add_process_set(list(range(0, SIZE, 2)))
    try:
        assert evens.size() == (SIZE + 1) // 2 and evens.included() == (RANK % 2 == 0)
        if evens.included():
            out = hvd.allreduce(tf.constant([float(RANK)]), op=hvd.Sum, process_set=evens)
            np.testing.assert_array_equal(out, [sum(range(0, SIZE, 2))])
            assert evens.rank() == RANK // 2
        else:
            assert evens.rank() == -1
        hvd.barrier()  # the other ranks waited meanwhile: the global set still agrees
    finally:
        assert hvd.remove_process_set(evens)


def test_disagreeing_ops_raise_failed_precondition_on_every_rank():
    if SIZE == 1:
        pytest.skip("needs two ranks")
    op = hvd.Sum if RANK == 0 else hvd.Max
    with pytest.raises(tf.errors.FailedPreconditionError, match=r"allreduce \(max\)"):
        hvd.allreduce(tf.ones([3]), op=op)
    with pytest.raises(tf.errors.FailedPreconditionError, match="root rank"):
        hvd.broadcast(tf.ones([3]), RANK)


def test_disagreeing_ops_inside_a_function_raise_failed_precondition_with_the_kernels():
    # Horovod's class, which an op's Python function cannot raise (there it
    # is UnknownError): the compiled kernels set it.
    from mpi_strategy._src.native import engine

    if SIZE == 1 or engine.active() != "native":
        pytest.skip("needs two ranks and the native kernels")
    op = hvd.Sum if RANK == 0 else hvd.Max
    with pytest.raises(
        tf.errors.FailedPreconditionError, match=r"MismatchError: .*allreduce \(max\)"
    ):
        tf.function(lambda: hvd.allreduce(tf.ones([3]), op=op))()
    with pytest.raises(tf.errors.FailedPreconditionError, match="root rank"):
        tf.function(lambda: hvd.broadcast(tf.ones([3]), RANK))()
    np.testing.assert_array_equal(hvd.allreduce(tf.ones([2]), op=hvd.Sum), [SIZE, SIZE])


def test_adasum_is_refused_clearly():
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.allreduce(tf.ones([2]), op=hvd.Adasum)


def test_distributed_gradient_tape_averages_and_keeps_local_sources_local():
    shared, local = tf.Variable([1.0, 2.0]), tf.Variable([3.0])
    with tf.GradientTape() as tape:
        loss = (RANK + 1) * (tf.reduce_sum(shared) + tf.reduce_sum(local))
    tape = hvd.DistributedGradientTape(tape, groups=1)
    tape.register_local_source(local)
    grad_shared, grad_local = tape.gradient(loss, [shared, local])
    np.testing.assert_allclose(grad_shared, [(SIZE + 1) / 2] * 2)
    np.testing.assert_allclose(grad_local, [(RANK + 1) / SIZE])


def test_distributed_gradient_tape_with_fp16_compression_in_a_function():
    v = tf.Variable(tf.ones([5]))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * v) * (RANK + 1)
        return hvd.DistributedGradientTape(tape, compression=hvd.Compression.fp16).gradient(loss, v)

    grad = step()
    assert grad.dtype == tf.float32
    np.testing.assert_allclose(grad, [SIZE + 1] * 5)
    assert_same_on_all_ranks(grad.numpy(), "averaged gradient")


# Bytes each rank sends under the bandwidth-optimal algorithms MPI libraries
# use for large messages, for a collective the timeline records with this
# rank's payload: Allreduce (reduce-scatter, then allgather) 2 (p-1)/p of its
# buffer; Alltoall all rows but its own; Allgather its piece to p-1 ranks.
WIRE_SHARE = {
    "allreduce": lambda b: 2 * (SIZE - 1) * b / SIZE,
    "alltoall": lambda b: (SIZE - 1) * b / SIZE,
    "all_gather": lambda b: (SIZE - 1) * b,
}


def _bytes_on_the_wire(monkeypatch, path, compression):
    """One averaged gradient of 16,384 float32 values through
    DistributedGradientTape, with the timeline on: the gradient and the bytes
    this rank sends for it."""
    monkeypatch.setenv(timeline.ENV_VAR, path)
    v = tf.Variable(tf.ones([64, 256]))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * v) * (RANK + 1)
        return hvd.DistributedGradientTape(tape, compression=compression).gradient(loss, v)

    grad = step()
    timeline_lib.current().close()
    events = timeline.read_events(timeline.rank_path(path, RANK))
    sent = [(e["name"], e["args"]["bytes"]) for e in events if e["name"] in WIRE_SHARE]
    return grad, sum(WIRE_SHARE[name](b) for name, b in sent), sent


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_sixteen_bit_compression_halves_the_bytes_on_the_wire(monkeypatch, shared_dir, compression):
    """Horovod users turn on Compression.fp16 to halve the bytes: the values
    travel in 16 bits (not widened to float32 for the sum), every rank gets
    the same average, within 16-bit rounding of the exact one."""
    if SIZE == 1:
        pytest.skip("one rank sends nothing")
    plain, plain_bytes, _ = _bytes_on_the_wire(
        monkeypatch, f"{shared_dir}/none.json", hvd.Compression.none
    )
    grad, half_bytes, sent = _bytes_on_the_wire(
        monkeypatch, f"{shared_dir}/{compression}.json", getattr(hvd.Compression, compression)
    )
    print(
        f"bytes on the wire per step, rank {RANK}: none {plain_bytes:.0f}, {compression} "
        f"{half_bytes:.0f} ({sent})"
    )
    # (a few bytes more where the ranks do not divide the values evenly)
    assert half_bytes == pytest.approx(plain_bytes / 2, rel=1e-3), (plain_bytes, sent)
    assert grad.dtype == tf.float32
    np.testing.assert_allclose(grad, plain, rtol=1e-2)
    assert_same_on_all_ranks(grad.numpy(), "averaged gradient")


def test_ranks_and_sizes():
    assert (hvd.rank(), hvd.size()) == (RANK, SIZE)
    assert 0 <= hvd.local_rank() < hvd.local_size() <= SIZE
    assert hvd.cross_size() * hvd.local_size() == SIZE or not hvd.is_homogeneous()
    assert int(hvd.rank_op()) == RANK and int(hvd.size_op()) == SIZE
    assert hvd.mpi_built() and hvd.mpi_enabled() and not hvd.gloo_built() and not hvd.nccl_built()


def test_bad_splits_on_one_rank_raise_on_every_rank():
    if SIZE == 1:
        pytest.skip("needs two ranks")
    splits = [1] * SIZE if RANK else [2] * SIZE  # rank 0's splits exceed its rows
    with pytest.raises(tf.errors.FailedPreconditionError, match=r"splits of rank\(s\) \[0\]"):
        hvd.alltoall(tf.ones([SIZE, 2]), splits=splits)
    hvd.barrier()  # and the ranks still agree afterwards
