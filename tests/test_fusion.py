"""mpi_strategy.fusion: one collective per wire dtype, results unpacked exactly."""

import numpy as np
import tensorflow as tf

from mpi_strategy import fusion


def _recording(calls):
    def allreduce_packed(xs):
        calls.append([(x.dtype, tuple(x.shape)) for x in xs])
        return [x * 2 for x in xs]  # stands in for "sum over two ranks"
    return allreduce_packed


def test_one_call_per_wire_dtype_in_first_appearance_order():
    tensors = [tf.ones([2, 3]), tf.ones([4], tf.float64), tf.ones([], tf.float16),
               tf.ones([1, 1], tf.bfloat16), tf.ones([5], tf.int32), tf.ones([3, 2])]
    calls = []
    out = fusion.fused_allreduce(tensors, _recording(calls))
    # float32 (incl. float16/bfloat16 summed as float32), float64, int32.
    assert [[dtype for dtype, _ in call] for call in calls] == [
        [tf.float32] * 4, [tf.float64], [tf.int32]]
    assert [shape for _, shape in calls[0]] == [(2, 3), (), (1, 1), (3, 2)]
    for t, o in zip(tensors, out):
        assert o.dtype == t.dtype and o.shape == t.shape
        np.testing.assert_array_equal(tf.cast(o, tf.float64).numpy(),
                                      2 * tf.cast(t, tf.float64).numpy())


def test_unknown_shapes_inside_a_function():
    @tf.function(input_signature=[tf.TensorSpec([None, 2]), tf.TensorSpec([None])])
    def f(a, b):
        return fusion.fused_allreduce([a, b], lambda xs: [x * 3 for x in xs])

    a, b = f(tf.ones([3, 2]), tf.ones([4]))
    assert a.shape == (3, 2) and b.shape == (4,)
    assert float(tf.reduce_sum(a)) == 18 and float(tf.reduce_sum(b)) == 12
