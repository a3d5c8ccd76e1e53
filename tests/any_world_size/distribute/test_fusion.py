"""distribute/fusion.py: one collective per wire dtype, results unpacked exactly."""

import numpy as np
import tensorflow as tf

from mpi_strategy._src.distribute import fusion
from mpi_testing import SIZE


def _recording(calls):
    def allreduce_packed(xs):
        calls.append([(x.dtype, tuple(x.shape)) for x in xs])
        return [x * 2 for x in xs]  # stands in for "sum over two ranks"

    return allreduce_packed


def test_one_call_per_wire_dtype_in_first_appearance_order():
    tensors = [
        tf.ones([2, 3]),
        tf.ones([4], tf.float64),
        tf.ones([], tf.float16),
        tf.ones([1, 1], tf.bfloat16),
        tf.ones([5], tf.int32),
        tf.ones([3, 2]),
    ]
    calls = []
    out = fusion.fused_allreduce(tensors, _recording(calls))
    # float32 (incl. float16/bfloat16 summed as float32), float64, int32.
    assert [[dtype for dtype, _ in call] for call in calls] == [
        [tf.float32] * 4,
        [tf.float64],
        [tf.int32],
    ]
    assert [shape for _, shape in calls[0]] == [(2, 3), (), (1, 1), (3, 2)]
    for t, o in zip(tensors, out):
        assert o.dtype == t.dtype and o.shape == t.shape
        np.testing.assert_array_equal(
            tf.cast(o, tf.float64).numpy(), 2 * tf.cast(t, tf.float64).numpy()
        )


def test_unknown_shapes_inside_a_function():
    @tf.function(input_signature=[tf.TensorSpec([None, 2]), tf.TensorSpec([None])])
    def f(a, b):
        return fusion.fused_allreduce([a, b], lambda xs: [x * 3 for x in xs])

    a, b = f(tf.ones([3, 2]), tf.ones([4]))
    assert a.shape == (3, 2) and b.shape == (4,)
    assert float(tf.reduce_sum(a)) == 18 and float(tf.reduce_sum(b)) == 12


# -- buckets (CommunicationOptions.bytes_per_pack) -------------------------------------------
def test_buckets_are_built_from_the_last_tensor_backwards():
    sizes = [100, 10, 300, 20, 50, 5]
    assert fusion.buckets(sizes, 0) == [[0, 1, 2, 3, 4, 5]]  # the default: one call
    # Each bucket closes once it holds >= 60 bytes; the last tensors come first.
    assert fusion.buckets(sizes, 60) == [[3, 4, 5], [2], [0, 1]]
    assert fusion.buckets(sizes, 1) == [[5], [4], [3], [2], [1], [0]]
    assert fusion.buckets(sizes, 10_000) == [[0, 1, 2, 3, 4, 5]]
    assert fusion.buckets([8, None, 8, 8], 100) == [[1, 2, 3], [0]]  # unknown size: closes


def test_one_call_per_bucket_last_layers_first_and_same_results():
    # A model's gradients: kernel, bias, kernel, bias, ... first layer first.
    tensors = [
        tf.ones([30, 20]),
        tf.ones([20]),
        tf.ones([20, 10], tf.float16),
        tf.ones([10]),
        tf.ones([3], tf.int32),
    ]
    calls = []
    out = fusion.fused_allreduce(tensors, _recording(calls), bytes_per_pack=900)
    assert [[shape for _, shape in call] for call in calls] == [
        [(20,), (20, 10), (10,)],  # 80 + 800 + 40 bytes on the wire (float16 as float32)
        [(30, 20)],
        [(3,)],
    ]  # the int32 group
    for t, o in zip(tensors, out):
        assert o.dtype == t.dtype and o.shape == t.shape
        np.testing.assert_array_equal(
            tf.cast(o, tf.float64).numpy(), 2 * tf.cast(t, tf.float64).numpy()
        )


def _gradients_of_this_rank(rank):
    """Tensors whose sums depend on the order of summation (magnitudes 1e-4..1e4),
    from a few bytes (carried in the agreement) to MBs (MPI's large-message path)."""
    rng = np.random.default_rng(1234 + rank)
    shapes = [(512, 1024), (1024,), (1024, 256), (256,), (256, 10), (10,)]

    def values(shape, dtype):
        scale = 10.0 ** rng.uniform(-4, 4, size=shape)
        return tf.constant(rng.standard_normal(shape) * scale, dtype)

    return [values(s, tf.float32) for s in shapes] + [
        values((3, 7), tf.float64),
        values((100,), tf.float16),
    ]


def _summation_order_may_depend_on_message_size():
    """At 2 ranks a sum is a + b whatever MPI does. At more ranks, Open MPI picks
    its allreduce algorithm, hence its order of summation, by message size
    (measured: a bucket alone and the same tensor in a fused buffer differ in
    the last bit at 3 ranks); MPICH's algorithms add (x0 + x1) + x2 at these
    sizes."""
    from mpi_testing import SIZE
    from testing.launch import is_open_mpi

    return SIZE > 2 and is_open_mpi()


def test_bucketed_sums_are_bit_identical_to_one_fused_call_on_every_rank():
    from mpi_strategy import MPICrossDeviceOps
    from mpi_testing import RANK, SIZE, WORLD, all_ranks_agree, assert_same_on_all_ranks

    ops = MPICrossDeviceOps(WORLD)
    grads = _gradients_of_this_rank(RANK)
    seq = ops.ordered_comm.agreement.seq
    reference = [t.numpy() for t in ops.all_reduce_values("SUM", grads, bytes_per_pack=0)]
    assert ops.ordered_comm.agreement.seq - seq == (2 if SIZE > 1 else 0)  # one per wire dtype
    # 1: every tensor alone (incl. 40-byte ones, summed in the agreement);
    # 64 KiB / 1 MiB: medium and MB-sized messages.
    for bytes_per_pack in (1, 64 << 10, 1 << 20):
        seq = ops.ordered_comm.agreement.seq
        summed = ops.all_reduce_values("SUM", grads, bytes_per_pack=bytes_per_pack)
        expected_calls = sum(
            len(
                fusion.buckets(
                    [
                        t.shape.num_elements() * fusion.wire_dtype(t.dtype).size
                        for t in grads
                        if fusion.wire_dtype(t.dtype) == dtype
                    ],
                    bytes_per_pack,
                )
            )
            for dtype in (tf.float32, tf.float64)
        )
        assert ops.ordered_comm.agreement.seq - seq == (expected_calls if SIZE > 1 else 0)
        for i, (s, r) in enumerate(zip(summed, reference)):
            if _summation_order_may_depend_on_message_size():
                np.testing.assert_allclose(
                    s.numpy(), r, rtol=1e-5 if r.dtype == np.float16 else 1e-6
                )
            else:
                assert all_ranks_agree(s.numpy().tobytes() == r.tobytes()), (
                    f"tensor {i} {r.shape} differs with bytes_per_pack={bytes_per_pack}"
                )
            assert_same_on_all_ranks(s.numpy(), f"tensor {i}")
    if SIZE > 2:  # the check has teeth: the order of summation changes these sums
        x = [_gradients_of_this_rank(r)[0].numpy() for r in range(3)]
        assert np.any((x[0] + x[1]) + x[2] != x[0] + (x[1] + x[2]))


def test_bucketed_reduction_inside_a_function_matches_eager():
    from mpi_strategy import MPICrossDeviceOps
    from mpi_testing import RANK, WORLD

    ops = MPICrossDeviceOps(
        WORLD, tf.distribute.experimental.CommunicationOptions(bytes_per_pack=256 << 10)
    )
    grads = _gradients_of_this_rank(RANK)
    eager = ops.all_reduce_values("SUM", grads, bytes_per_pack=0)
    traced = tf.function(lambda: ops.all_reduce_values("SUM", grads))()  # options' 256 KiB
    for e, t in zip(eager, traced):
        assert e.numpy().tobytes() == t.numpy().tobytes()


def test_bytes_per_pack_passed_per_call_is_honoured(strategy):
    """CommunicationOptions given to one reduction (strategy.extended.batch_reduce_to,
    ReplicaContext.all_reduce) set its buckets, as the strategy-level option does."""
    grads = [tf.ones([100]), tf.ones([200]), tf.ones([300])]
    options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=1)
    agreement = strategy.extended._cross_device_ops.ordered_comm.agreement

    def calls(fn):
        before = agreement.seq
        fn()
        return agreement.seq - before

    cross_replica = calls(
        lambda: strategy.extended.batch_reduce_to(
            "SUM", [(g, "/device:CPU:0") for g in grads], options=options
        )
    )
    in_replica = calls(
        lambda: strategy.run(
            tf.function(
                lambda: tf.distribute.get_replica_context().all_reduce(
                    "SUM", grads, options=options
                )
            )
        )
    )
    default = calls(
        lambda: strategy.run(
            tf.function(lambda: tf.distribute.get_replica_context().all_reduce("SUM", grads))
        )
    )
    if SIZE > 1:
        assert (cross_replica, in_replica, default) == (3, 3, 1)
