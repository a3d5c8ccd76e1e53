"""How many dense tensors become few MPI messages: one fused buffer per dtype.

``fused_allreduce(tensors, allreduce)`` flattens and concatenates the tensors
that share a wire dtype, sums the buffer with one ``allreduce`` call, and
splits it back. float16 and bfloat16 travel and are summed as float32 (MPI
has no portable half-precision sum), then cast back.
"""

import tensorflow as tf

# Dtypes that are summed in a wider dtype, and the one they are summed in.
_WIRE_DTYPE = {tf.float16: tf.float32, tf.bfloat16: tf.float32}


def wire_dtype(dtype):
    return _WIRE_DTYPE.get(dtype, dtype)


def fused_allreduce(tensors, allreduce):
    """Sums each tensor across ranks with one ``allreduce`` call per wire dtype.

    Args:
      tensors: a list of dense tensors (any shapes).
      allreduce: a function summing one tensor across ranks.

    Returns:
      A list of tensors matching ``tensors`` in order, shape and dtype.
    """
    groups = {}  # wire dtype -> indices; dict keeps first-appearance order,
    for i, t in enumerate(tensors):  # which is the same on every rank.
        groups.setdefault(wire_dtype(t.dtype), []).append(i)

    results = [None] * len(tensors)
    for dtype, indices in groups.items():
        members = [tf.cast(tensors[i], dtype) for i in indices]
        if len(members) == 1:
            summed = [allreduce(members[0])]
        else:
            flat = tf.concat([tf.reshape(m, [-1]) for m in members], axis=0)
            sizes = [tf.size(m) for m in members]
            pieces = tf.split(allreduce(flat), tf.stack(sizes), num=len(members))
            summed = [tf.reshape(p, tf.shape(m)) for p, m in zip(pieces, members)]
        for i, s in zip(indices, summed):
            s = tf.cast(s, tensors[i].dtype)
            s.set_shape(tensors[i].shape)
            results[i] = s
    return results
