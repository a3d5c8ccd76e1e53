"""How a fused group of floating-point tensors is summed on the wire: exactly, or in 16 bits.

``MPIStrategy(compression="float16")`` (or ``"bfloat16"``) sends every
float32/float64 tensor of at least ``MIN_BYTES`` in an all-reduce - in
practice the weight gradients of a step - in half the bytes of float32.
Smaller tensors (losses, metrics, biases) and integers are summed exactly.

The compressed sum moves the bytes as MPI's large-message Allreduce does
(reduce-scatter, then allgather: each rank sends and receives 2 (p-1)/p of the
data), in 16-bit values: every rank rounds its values to 16 bits and sends
slice ``r`` to rank ``r`` (one Alltoall); rank ``r`` adds the p pieces of its
slice in float32, in rank order, and rounds the sum to 16 bits once; one
Allgather gives every rank every slice. So each element is rounded twice (the
inputs and the sum, never the partial sums hop by hop; float64 values by way
of float32), and every rank gets bit-identical results. float16 keeps 11 significant bits but a value or sum
above 65504 becomes inf (a dynamic loss scale, as in Keras' mixed precision,
backs off from it like from any overflow; otherwise prefer bfloat16);
bfloat16 keeps float32's range with 8 significant bits.

A policy is any object with ``allreduce(tensors, mpi, timeout)`` summing a
list of tensors of one dtype over the ranks of ``mpi`` (an ``OrderedComm``).
"""

import tensorflow as tf

MIN_BYTES = 16 * 1024  # smaller tensors are summed exactly


class Exact:
    """Sums in the tensors' own dtype: one in-place Allreduce of the packed group."""

    name = "none"

    def allreduce(self, tensors, mpi, timeout=None):
        return mpi.allreduce_sum_packed(tensors, timeout)


class SixteenBit(Exact):
    """Large float32/float64 groups travel as ``wire_dtype`` (float16 or bfloat16)."""

    def __init__(self, wire_dtype):
        self.wire_dtype = tf.as_dtype(wire_dtype)
        self.name = self.wire_dtype.name

    def allreduce(self, tensors, mpi, timeout=None):
        dtype = tensors[0].dtype
        if mpi.size == 1 or dtype not in (tf.float32, tf.float64):
            return super().allreduce(tensors, mpi, timeout)
        large = [i for i, t in enumerate(tensors)
                 if (t.shape.num_elements() or 0) * dtype.size >= MIN_BYTES]
        small = sorted(set(range(len(tensors))) - set(large))
        results = [None] * len(tensors)
        if small:
            for i, r in zip(small, super().allreduce([tensors[i] for i in small], mpi, timeout)):
                results[i] = r
        if large:
            for i, r in zip(large, self._allreduce_16([tensors[i] for i in large], mpi, timeout)):
                results[i] = r
        return results

    def _allreduce_16(self, tensors, mpi, timeout):
        dtype = tensors[0].dtype
        sizes = [t.shape.num_elements() for t in tensors]
        p, n = mpi.size, sum(sizes)
        chunk = -(-n // p)
        flat = tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in tensors], axis=0)
        flat = tf.pad(flat, [[0, chunk * p - n]])
        # Row r: this rank's values of the slice that rank r sums.
        pieces = mpi.alltoall(self._to_wire(tf.reshape(flat, [p, chunk])), timeout)
        my_slice = tf.reduce_sum(self._from_wire(pieces), axis=0)
        summed = mpi.allgather(self._to_wire(my_slice[tf.newaxis]), timeout)
        summed = tf.cast(tf.reshape(self._from_wire(summed), [-1])[:n], dtype)
        return [tf.reshape(part, t.shape)
                for part, t in zip(tf.split(summed, sizes), tensors)]

    def _to_wire(self, values):
        # Bit patterns as uint16: MPI only moves the bytes.
        return tf.bitcast(tf.cast(values, self.wire_dtype), tf.uint16)

    def _from_wire(self, bits):
        return tf.cast(tf.bitcast(bits, self.wire_dtype), tf.float32)


_BY_NAME = {None: Exact, "none": Exact,
            "float16": lambda: SixteenBit(tf.float16),
            "bfloat16": lambda: SixteenBit(tf.bfloat16)}


def resolve(compression):
    """The policy for ``compression``: None, "float16", "bfloat16" or a policy object."""
    if hasattr(compression, "allreduce"):
        return compression
    if isinstance(compression, str) or compression is None:
        key = compression.lower() if isinstance(compression, str) else None
        if key in _BY_NAME:
            return _BY_NAME[key]()
    raise ValueError(
        f"mpi_strategy: compression must be None, 'float16' or 'bfloat16' (or an object "
        f"with an allreduce(tensors, mpi, timeout) method); got {compression!r}.")
