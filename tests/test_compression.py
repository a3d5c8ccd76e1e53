"""mpi_strategy.compression: 16-bit wire reductions, at any world size."""

import numpy as np
import pytest
import tensorflow as tf

from mpi_testing import (NUM_REPLICAS, RANK, SIZE, WORLD, assert_same_on_all_ranks,
                          local_devices)
from mpi_strategy import MPICrossDeviceOps, MPIStrategy, compression
from mpi_strategy.errors import MPIStrategyError
from mpi_strategy.mpi_ops import OrderedComm

WIRE = {"float16": np.float16, "bfloat16": tf.bfloat16.as_numpy_dtype}
SHAPES = [(300, 70), (70, 80), (5000,)]  # each over MIN_BYTES (16 KiB) in float32


@pytest.fixture(scope="module")
def mpi():
    return OrderedComm(WORLD)


def _rank_values(rank, dtype=np.float32):
    rng = np.random.default_rng(100 + rank)
    return [(rng.standard_normal(s) * 10).astype(dtype) for s in SHAPES]


def _expected(wire, dtype=np.float32):
    # Inputs rounded to 16 bits (float64 by way of float32), summed in float32
    # in rank order, rounded once more.
    total = sum(np.concatenate([v.reshape(-1) for v in _rank_values(r, dtype)])
                .astype(np.float32).astype(WIRE[wire]).astype(np.float32) for r in range(SIZE))
    return total.astype(WIRE[wire]).astype(dtype)


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
def test_sixteen_bit_sum_rounds_inputs_and_sum_only(mpi, wire, dtype, in_function):
    policy = compression.resolve(wire)
    tensors = [tf.constant(v) for v in _rank_values(RANK, dtype)]
    fn = policy.allreduce
    if in_function:
        fn = tf.function(lambda ts: policy.allreduce(ts, mpi))
        out = fn(tensors)
    else:
        out = fn(tensors, mpi)
    assert [o.shape for o in out] == [t.shape for t in tensors]
    assert all(o.dtype == dtype for o in out)
    flat = np.concatenate([o.numpy().reshape(-1) for o in out])
    if SIZE == 1:  # nothing to send: exact
        np.testing.assert_array_equal(flat, np.concatenate([v.reshape(-1) for v in _rank_values(0, dtype)]))
    else:
        np.testing.assert_array_equal(flat, _expected(wire, dtype))
    assert_same_on_all_ranks(flat)


def test_large_tensors_go_16_bit_in_one_alltoall_and_allgather_small_ones_exact(mpi):
    if SIZE == 1:
        pytest.skip("a 1-rank world issues no MPI call")
    policy = compression.resolve("float16")
    tensors = [tf.zeros(s) for s in SHAPES] + [tf.zeros([]), tf.zeros([10])]
    graph = tf.function(lambda: policy.allreduce(tensors, mpi)).get_concrete_function().graph
    calls = {op.name.split("/")[-1].rstrip("_0123456789"): op
             for op in graph.get_operations() if op.type == "PyFunc"}
    assert sorted(calls) == ["MPIAllgather", "MPIAllreduce", "MPIAlltoall"], sorted(calls)
    # 16-bit values on the wire: half the bytes of float32.
    for name in ("MPIAllgather", "MPIAlltoall"):
        assert [t.dtype for t in calls[name].inputs[1:]] == [tf.uint16], calls[name].inputs
    assert [t.shape for t in calls["MPIAllreduce"].inputs[1:]] == [(), (10,)]


def test_small_integer_and_unknown_reductions_stay_exact(mpi):
    policy = compression.resolve("bfloat16")
    small = [tf.constant([1.0 + 2 ** -20 * RANK, 3.0])]  # bfloat16 would round this
    out = policy.allreduce(small, mpi)[0].numpy()
    np.testing.assert_array_equal(
        out, np.array([sum(1.0 + 2 ** -20 * r for r in range(SIZE)), 3.0 * SIZE], np.float32))
    ints = [tf.fill([40000], RANK + 1)]  # 160 KB of int32: never compressed
    assert int(policy.allreduce(ints, mpi)[0][0]) == SIZE * (SIZE + 1) // 2


def test_strategy_compresses_gradients_but_not_the_loss():
    strategy = MPIStrategy(devices=local_devices(), compression="float16")
    with strategy.scope():
        weights = tf.Variable(tf.zeros([200, 100]))

    @tf.function
    def step():
        def fn():
            r = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
            grads = tf.fill([200, 100], 0.1 + r)
            loss = 1.0 + r * 2 ** -20
            return tf.distribute.get_replica_context().all_reduce("SUM", [grads, loss])
        return strategy.experimental_local_results(strategy.run(fn))[0]

    grads, loss = step()
    # Each rank first sums its own replicas exactly, then the ranks' sums are
    # rounded to float16, added in float32 and rounded once more.
    local = NUM_REPLICAS // SIZE
    per_rank = [sum(np.float32(0.1 + k * local + j) for j in range(local))
                for k in range(SIZE)]
    exact = sum(per_rank)
    rounded = np.float16(sum(np.float32(np.float16(v)) for v in per_rank))
    if SIZE > 1:
        assert float(grads[0, 0]) == float(rounded) != float(exact)
    assert float(loss) == pytest.approx(sum(1.0 + r * 2 ** -20 for r in range(NUM_REPLICAS)),
                                        abs=0, rel=1e-7)
    del weights


def test_bad_compression_is_a_clear_error():
    with pytest.raises(ValueError, match="compression must be None, 'float16' or 'bfloat16'"):
        MPICrossDeviceOps(compression="int8")


def test_ranks_must_agree_on_compression():
    if SIZE == 1:
        pytest.skip("needs two ranks to disagree")
    with pytest.raises(MPIStrategyError, match="compression .* differs between ranks"):
        MPICrossDeviceOps(compression="float16" if RANK == 0 else None)


def test_keras_fit_with_bfloat16_compression_keeps_ranks_identical():
    strategy = MPIStrategy(devices=local_devices(), compression="bfloat16")
    rng = np.random.default_rng(0)
    x = rng.random((64 * NUM_REPLICAS, 100)).astype(np.float32)
    y = (x @ rng.standard_normal((100, 1)) > 0).astype(np.float32)
    with strategy.scope():
        tf.keras.utils.set_random_seed(3)
        model = tf.keras.Sequential([tf.keras.Input((100,)),
                                     tf.keras.layers.Dense(64, activation="relu"),  # 25.6 KB
                                     tf.keras.layers.Dense(1)])
        model.compile(tf.keras.optimizers.SGD(0.1),
                      tf.keras.losses.BinaryCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=8 * NUM_REPLICAS, epochs=3, verbose=0, shuffle=False)
    assert history.history["loss"][-1] < history.history["loss"][0]
    for w in model.get_weights():
        assert_same_on_all_ranks(w)


def test_float16_overflow_is_inf_and_bfloat16_keeps_the_range(mpi):
    if SIZE == 1:
        pytest.skip("a 1-rank world sends nothing, so nothing is rounded")
    big = [tf.fill([8192], 7e4)]  # 32 KB, above float16's largest value 65504
    assert np.isinf(compression.resolve("float16").allreduce(big, mpi)[0].numpy()).all()
    out = compression.resolve("bfloat16").allreduce(big, mpi)[0].numpy()
    np.testing.assert_allclose(out, 7e4 * SIZE, rtol=2 ** -7)
