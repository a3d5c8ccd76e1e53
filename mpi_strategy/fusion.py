"""How many dense tensors become few MPI messages: one fused message per dtype.

``fused_allreduce(tensors, allreduce_packed)`` groups the tensors by the dtype
they travel in and sums each group with one ``allreduce_packed`` call (which
packs the group into one buffer). float16 and bfloat16 travel and are summed
as float32 (MPI has no portable half-precision sum), then cast back.
"""

import tensorflow as tf

# Dtypes that are summed in a wider dtype, and the one they are summed in.
_WIRE_DTYPE = {tf.float16: tf.float32, tf.bfloat16: tf.float32}


def wire_dtype(dtype):
    return _WIRE_DTYPE.get(dtype, dtype)


def fused_allreduce(tensors, allreduce_packed):
    """Sums each tensor across ranks with one ``allreduce_packed`` call per wire dtype.

    Args:
      tensors: a list of dense tensors (any shapes).
      allreduce_packed: sums a list of tensors of one dtype across ranks in one
        message (``OrderedComm.allreduce_sum_packed``).

    Returns:
      A list of tensors matching ``tensors`` in order, shape and dtype.
    """
    groups = {}  # wire dtype -> indices; dict keeps first-appearance order,
    for i, t in enumerate(tensors):  # which is the same on every rank.
        groups.setdefault(wire_dtype(t.dtype), []).append(i)

    results = [None] * len(tensors)
    for dtype, indices in groups.items():
        summed = allreduce_packed([tf.cast(tensors[i], dtype) for i in indices])
        for i, s in zip(indices, summed):
            s = tf.cast(s, tensors[i].dtype)
            s.set_shape(tensors[i].shape)
            results[i] = s
    return results
