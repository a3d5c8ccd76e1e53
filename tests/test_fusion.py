"""mpi_strategy.fusion: one collective per wire dtype, results unpacked exactly."""

import numpy as np
import tensorflow as tf

from mpi_strategy import fusion


def _recording(calls):
    def allreduce(x):
        calls.append((x.dtype, x.shape))
        return x * 2  # stands in for "sum over two ranks"
    return allreduce


def test_one_call_per_wire_dtype_in_first_appearance_order():
    tensors = [tf.ones([2, 3]), tf.ones([4], tf.float64), tf.ones([], tf.float16),
               tf.ones([1, 1], tf.bfloat16), tf.ones([5], tf.int32), tf.ones([3, 2])]
    calls = []
    out = fusion.fused_allreduce(tensors, _recording(calls))
    # float32 (incl. float16/bfloat16 summed as float32), float64, int32.
    assert [c[0] for c in calls] == [tf.float32, tf.float64, tf.int32]
    assert calls[0][1] == (6 + 1 + 1 + 6,)
    for t, o in zip(tensors, out):
        assert o.dtype == t.dtype and o.shape == t.shape
        np.testing.assert_array_equal(tf.cast(o, tf.float64).numpy(),
                                      2 * tf.cast(t, tf.float64).numpy())


def test_values_land_in_their_own_tensors():
    tensors = [tf.reshape(tf.range(6, dtype=tf.float32), [2, 3]), tf.constant([10.0, 20.0])]
    out = fusion.fused_allreduce(tensors, lambda x: x + tf.range(tf.size(x), dtype=x.dtype))
    np.testing.assert_array_equal(out[0].numpy(), [[0, 2, 4], [6, 8, 10]])
    np.testing.assert_array_equal(out[1].numpy(), [16.0, 27.0])


def test_unknown_shapes_inside_a_function():
    @tf.function(input_signature=[tf.TensorSpec([None, 2]), tf.TensorSpec([None])])
    def f(a, b):
        return fusion.fused_allreduce([a, b], lambda x: x * 3)

    a, b = f(tf.ones([3, 2]), tf.ones([4]))
    assert a.shape == (3, 2) and b.shape == (4,)
    assert float(tf.reduce_sum(a)) == 18 and float(tf.reduce_sum(b)) == 12
