"""distribute/compression.py (public as mpi_strategy.compression): 16-bit wire
reductions, at any world size."""

import numpy as np
import pytest
import tensorflow as tf

from mpi_strategy import MPICrossDeviceOps, MPIStrategy, compression
from mpi_strategy._src.distribute.ordered_comm import OrderedComm
from mpi_strategy.errors import MPIStrategyError
from mpi_testing import (
    NUM_REPLICAS,
    RANK,
    SIZE,
    WORLD,
    assert_same_on_all_ranks,
    local_devices,
    mpi_calls,
)

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
    total = sum(
        np.concatenate([v.reshape(-1) for v in _rank_values(r, dtype)])
        .astype(np.float32)
        .astype(WIRE[wire])
        .astype(np.float32)
        for r in range(SIZE)
    )
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
        np.testing.assert_array_equal(
            flat, np.concatenate([v.reshape(-1) for v in _rank_values(0, dtype)])
        )
    else:
        np.testing.assert_array_equal(flat, _expected(wire, dtype))
    assert_same_on_all_ranks(flat)


def test_large_tensors_go_16_bit_in_one_alltoall_and_allgather_small_ones_exact(mpi):
    if SIZE == 1:
        pytest.skip("a 1-rank world issues no MPI call")
    policy = compression.resolve("float16")
    tensors = [tf.zeros(s) for s in SHAPES] + [tf.zeros([]), tf.zeros([10])]
    graph = tf.function(lambda: policy.allreduce(tensors, mpi)).get_concrete_function().graph
    calls = dict(mpi_calls(graph))
    assert sorted(calls) == ["MPIAllgather", "MPIAllreduce", "MPIAlltoall"], sorted(calls)
    # 16-bit values on the wire: half the bytes of float32.
    for name in ("MPIAllgather", "MPIAlltoall"):
        assert [t.dtype for t in calls[name].inputs[1:]] == [tf.uint16], calls[name].inputs
    # The two small ones, exact, in one call: concatenated by TensorFlow into one
    # input for the Python engine, or taken as they are by the kernel, which
    # sends the bytes of that concatenation (mpi_ops).
    reduced = calls["MPIAllreduce"]
    if reduced.type == "PyFunc":
        assert [(t.dtype, t.shape) for t in reduced.inputs[1:]] == [(tf.float32, (11,))]
    else:
        assert [(t.dtype, t.shape) for t in reduced.inputs[1:]] == [
            (tf.float32, ()),
            (tf.float32, (10,)),
        ]
        assert reduced.get_attr("contiguous") == 1


def test_small_integer_and_unknown_reductions_stay_exact(mpi):
    policy = compression.resolve("bfloat16")
    small = [tf.constant([1.0 + 2**-20 * RANK, 3.0])]  # bfloat16 would round this
    out = policy.allreduce(small, mpi)[0].numpy()
    np.testing.assert_array_equal(
        out, np.array([sum(1.0 + 2**-20 * r for r in range(SIZE)), 3.0 * SIZE], np.float32)
    )
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
            loss = 1.0 + r * 2**-20
            return tf.distribute.get_replica_context().all_reduce("SUM", [grads, loss])

        return strategy.experimental_local_results(strategy.run(fn))[0]

    grads, loss = step()
    # Each rank first sums its own replicas exactly, then the ranks' sums are
    # rounded to float16, added in float32 and rounded once more.
    local = NUM_REPLICAS // SIZE
    per_rank = [sum(np.float32(0.1 + k * local + j) for j in range(local)) for k in range(SIZE)]
    exact = sum(per_rank)
    rounded = np.float16(sum(np.float32(np.float16(v)) for v in per_rank))
    if SIZE > 1:
        assert float(grads[0, 0]) == float(rounded) != float(exact)
    assert float(loss) == pytest.approx(
        sum(1.0 + r * 2**-20 for r in range(NUM_REPLICAS)), abs=0, rel=1e-7
    )
    del weights


def test_bad_compression_is_a_clear_error():
    with pytest.raises(ValueError, match="compression must be None, 'float16' or 'bfloat16'"):
        MPICrossDeviceOps(compression="int8")


def test_ranks_must_agree_on_compression():
    if SIZE == 1:
        pytest.skip("needs two ranks to disagree")
    with pytest.raises(MPIStrategyError, match=r"compression .* differs between ranks"):
        MPICrossDeviceOps(compression="float16" if RANK == 0 else None)


def test_keras_fit_with_bfloat16_compression_keeps_ranks_identical():
    strategy = MPIStrategy(devices=local_devices(), compression="bfloat16")
    rng = np.random.default_rng(0)
    x = rng.random((64 * NUM_REPLICAS, 100)).astype(np.float32)
    y = (x @ rng.standard_normal((100, 1)) > 0).astype(np.float32)
    with strategy.scope():
        tf.keras.utils.set_random_seed(3)
        model = tf.keras.Sequential(
            [
                tf.keras.Input((100,)),
                tf.keras.layers.Dense(64, activation="relu"),  # 25.6 KB
                tf.keras.layers.Dense(1),
            ]
        )
        model.compile(
            tf.keras.optimizers.SGD(0.1), tf.keras.losses.BinaryCrossentropy(from_logits=True)
        )
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
    np.testing.assert_allclose(out, 7e4 * SIZE, rtol=2**-7)


# -- the policy protocol and the threshold ---------------------------------------------------
class _Named:
    name = "custom"


class _NoAllreduce(_Named):
    pass


class _AllreduceNotCallable(_Named):
    allreduce = 3


class _NoTimeout(_Named):
    def allreduce(self, tensors, mpi):
        return tensors


class _CommNotMpi(_Named):
    def allreduce(self, tensors, comm, timeout=None):
        return tensors


class _NameNotStr(compression.Exact):
    name = None


class _EmptyName(compression.Exact):
    name = ""


@pytest.mark.parametrize(
    "policy,error,message",
    [
        (_NoAllreduce(), TypeError, "_NoAllreduce has no `allreduce` method"),
        (_AllreduceNotCallable(), TypeError, "`allreduce` is not callable"),
        (
            _NoTimeout(),
            TypeError,
            r"`allreduce\(tensors, mpi\)` cannot be called as "
            r"allreduce\(tensors, mpi=..., timeout=...\)",
        ),
        (_CommNotMpi(), TypeError, r"`allreduce\(tensors, comm, timeout=None\)` cannot be called"),
        (_NameNotStr(), TypeError, "`name` must be a str"),
        (_EmptyName(), ValueError, "`name` is empty"),
    ],
    ids=[
        "no-allreduce",
        "not-callable",
        "no-timeout",
        "comm-not-mpi",
        "name-not-str",
        "empty-name",
    ],
)
def test_strategy_rejects_a_policy_that_breaks_the_protocol(policy, error, message):
    # Raised on every rank before any collective, so no rank is left waiting.
    with pytest.raises(error, match=message):
        MPIStrategy(devices=local_devices(), compression=policy)
    with pytest.raises(error, match=message):
        MPICrossDeviceOps(compression=policy)


@pytest.mark.parametrize(
    "wire,min_bytes,error,message",
    [
        ("float16", -1, ValueError, "min_bytes must be >= 0; got -1"),
        ("float16", 1.5, TypeError, "min_bytes must be an int; got 1.5"),
        ("float16", True, TypeError, "min_bytes must be an int; got True"),
        ("float32", 0, ValueError, "wire_dtype must be float16 or bfloat16; got float32"),
    ],
    ids=["negative", "float", "bool", "float32-wire"],
)
def test_sixteen_bit_rejects_bad_settings(wire, min_bytes, error, message):
    with pytest.raises(error, match=message):
        compression.SixteenBit(wire, min_bytes=min_bytes)


def test_the_name_carries_a_threshold_other_than_the_default():
    assert compression.resolve("float16").name == "float16"
    assert compression.resolve("bfloat16").min_bytes == compression.MIN_BYTES == 16 * 1024
    assert (
        compression.SixteenBit("bfloat16", min_bytes=np.int64(1024)).name
        == "bfloat16(min_bytes=1024)"
    )


@pytest.mark.parametrize("min_bytes", [1024, compression.MIN_BYTES])
def test_only_tensors_of_at_least_min_bytes_are_rounded(mpi, min_bytes):
    policy = (
        compression.resolve("bfloat16")
        if min_bytes == compression.MIN_BYTES
        else compression.SixteenBit("bfloat16", min_bytes=min_bytes)
    )
    value = 1 + 2**-10  # exact in float32, 1.0 in bfloat16
    elements = min_bytes // 4
    under, at = tf.fill([elements - 1], value), tf.fill([elements], value)
    out_under, out_at = (o.numpy() for o in policy.allreduce([under, at], mpi))
    np.testing.assert_array_equal(out_under, np.float32(value) * SIZE)
    # A 1-rank world sends nothing, so nothing is rounded.
    np.testing.assert_array_equal(out_at, np.float32(value if SIZE == 1 else SIZE))


def test_ranks_must_agree_on_the_threshold():
    if SIZE == 1:
        pytest.skip("needs two ranks to disagree")
    policy = compression.SixteenBit("float16", min_bytes=1024 if RANK == 0 else 2048)
    with pytest.raises(
        MPIStrategyError,
        match=r"compression \(here 'float16\(min_bytes=\d+\)'\) "
        "differs between ranks",
    ):
        MPICrossDeviceOps(compression=policy)


class _CountingExact(compression.Exact):
    """Exact sums, counting the groups (at trace time, as every policy is called)."""

    name = "counting-exact"

    def __init__(self):
        self.groups = 0

    def allreduce(self, tensors, mpi, timeout=None):
        self.groups += 1
        return super().allreduce(tensors, mpi, timeout)


def test_a_custom_policy_sums_the_strategys_reductions():
    policy = _CountingExact()
    strategy = MPIStrategy(devices=local_devices(), compression=policy)
    assert strategy.extended._cross_device_ops.compression == "counting-exact"

    @tf.function
    def step():
        def fn():
            ctx = tf.distribute.get_replica_context()
            replica = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
            return ctx.all_reduce("SUM", tf.fill([3], replica))

        return strategy.experimental_local_results(strategy.run(fn))[0]

    np.testing.assert_array_equal(step().numpy(), [sum(range(NUM_REPLICAS))] * 3)
    # TensorFlow skips the reduction of a single replica altogether.
    assert policy.groups == (1 if NUM_REPLICAS > 1 else 0)


def test_strategy_takes_a_sixteen_bit_policy_with_its_threshold():
    # The 200 x 100 float32 gradient (80,000 bytes) is just under the threshold: exact.
    strategy = MPIStrategy(
        devices=local_devices(), compression=compression.SixteenBit("float16", min_bytes=80_004)
    )
    assert strategy.extended._cross_device_ops.compression == "float16(min_bytes=80004)"

    @tf.function
    def step():
        def fn():
            ctx = tf.distribute.get_replica_context()
            replica = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
            return ctx.all_reduce("SUM", tf.fill([200, 100], 0.1 + replica))

        return strategy.experimental_local_results(strategy.run(fn))[0]

    exact = sum(np.float32(0.1 + r) for r in range(NUM_REPLICAS))
    # float16 would be off by far more than float32's summation-order error.
    assert float(step()[0, 0]) == pytest.approx(float(exact), rel=1e-6)
