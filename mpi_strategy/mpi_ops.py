"""MPI collectives as TensorFlow ops that every rank issues in the same order.

MPI matches collectives by call order only. Each collective here is one
stateful ``tf.numpy_function`` that reads and writes a per-communicator
*ordering token* (a scalar resource variable). TensorFlow orders all ops that
touch the same resource in program order, across ``tf.cond``, ``tf.while_loop``
and nested function calls, so the collectives of one communicator run strictly
one after another, in the order the program issued them, on every rank. This
is the same device TensorFlow uses for its own collectives (an ordering token
passed to ``CollectiveReduceV2``).

Inside each op, the ranks first agree on what the collective is
(``rendezvous.py``): a mismatch raises the same error on every rank, and an
optional timeout names the ranks that never arrived. Data crosses MPI as raw
buffers, never as pickles.
"""

import numpy as np
import tensorflow as tf
from mpi4py import MPI

from mpi_strategy import _tf_internal
from mpi_strategy import buffers
from mpi_strategy import rendezvous as rendezvous_lib
from mpi_strategy.errors import MPIStrategyError

# Dtypes MPI can sum natively. float16 / bfloat16 are summed in float32 by the
# caller (MPI has no portable half-precision reduction).
REDUCIBLE_DTYPES = (tf.float32, tf.float64, tf.int32, tf.int64)


class OrderedComm:
    """The graph-safe MPI operations of one communicator.

    Every method returns tensors holding the same value on every rank of
    ``comm``. In eager mode the call runs immediately; inside ``tf.function``
    it becomes one stateful op ordered after the previous MPI op of this
    communicator.
    """

    def __init__(self, comm, name_missing_ranks=False):
        """``name_missing_ranks``: make timeouts name the ranks that never
        arrived (costs a few bytes of point-to-point messages per collective
        when a timeout is used)."""
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._rendezvous = rendezvous_lib.Rendezvous(comm, name_missing_ranks)
        self._pool = buffers.BufferPool()
        # The token must be a plain (non-distributed) variable: create it
        # outside any tf.function, on the host.
        with tf.init_scope(), tf.device("/device:CPU:0"):
            self._token = tf.Variable(
                np.int64(0), trainable=False, name="mpi_ordering_token",
                synchronization=tf.VariableSynchronization.NONE)

    # -- the one place a TF op calls MPI -------------------------------------
    def _ordered_call(self, name, fn, inputs, output_dtypes):
        """Runs ``fn(*numpy_inputs) -> list of arrays`` as one ordered op."""
        def with_token(token, *arrays):
            return [token + 1] + list(fn(*arrays))

        with tf.device("/device:CPU:0"):
            token = self._token.read_value()
            outputs = tf.numpy_function(
                with_token, [token] + list(inputs), [tf.int64] + list(output_dtypes),
                stateful=True, name=name)
            self._token.assign(outputs[0])
        return outputs[1:]

    # -- collectives -----------------------------------------------------------
    def allreduce_sum(self, x, timeout=None):
        """Element-wise sum of ``x`` over all ranks (every rank gets the sum).

        ``timeout``: seconds to wait for the other ranks to reach this
        collective before raising (None: wait as long as MPI does, forever).
        """
        return self.allreduce_sum_packed([x], timeout)[0]

    def allreduce_sum_packed(self, tensors, timeout=None):
        """Sums each of ``tensors`` (all of one dtype) over all ranks, in one MPI call.

        The tensors are copied into one pooled buffer, summed in place by one
        MPI call and handed back as aligned views of it, which TensorFlow
        adopts without a copy (``buffers.py``): one copy in, none out, and the
        same memory every step once TensorFlow has let go of the previous one.
        """
        _check_not_xla("allreduce")
        if self.size == 1:
            return [tf.identity(t) for t in tensors]
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) != 1 or tensors[0].dtype not in REDUCIBLE_DTYPES:
            raise MPIStrategyError(
                f"mpi_strategy: cannot sum dtype(s) {sorted(d.name for d in dtypes)} in one "
                f"MPI call; supported: one of {[d.name for d in REDUCIBLE_DTYPES]} "
                "(float16/bfloat16 are summed in float32 by MPICrossDeviceOps).")
        comm, rendezvous, pool = self.comm, self._rendezvous, self._pool

        def allreduce(*arrays):
            rendezvous.agree(rendezvous_lib.ALLREDUCE, arrays[0].dtype,
                             [a.shape for a in arrays], timeout=timeout)
            buffer, outs = buffers.pack(arrays, pool)
            comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
            return outs

        outs = self._ordered_call("MPIAllreduce", allreduce, tensors,
                                  [t.dtype for t in tensors])
        for out, t in zip(outs, tensors):
            out.set_shape(t.shape)
        return outs

    def allgather(self, x, timeout=None):
        """Concatenation along axis 0 of ``x`` from every rank, in rank order.

        Ranks may contribute different numbers of rows; the other dimensions
        and the dtype must agree (checked on every rank, so all ranks raise).
        """
        _check_not_xla("allgather")
        if self.size == 1:
            return tf.identity(x)
        comm, rendezvous = self.comm, self._rendezvous

        def allgatherv(array):
            array = np.ascontiguousarray(array)
            rows = array.shape[0] if array.ndim else 1
            per_row = int(np.prod(array.shape[1:], dtype=np.int64))
            everyone = rendezvous.agree(rendezvous_lib.ALLGATHER, array.dtype,
                                        [array.shape[1:]], rows=rows, timeout=timeout)
            all_rows = everyone[:, -1]
            counts = (all_rows * per_row * array.itemsize).tolist()
            out = buffers.aligned_empty((int(all_rows.sum()),) + array.shape[1:], array.dtype)
            comm.Allgatherv([_bytes(array), MPI.BYTE], [_bytes(out), (counts, None), MPI.BYTE])
            return (out,)

        (out,) = self._ordered_call("MPIAllgather", allgatherv, [x], [x.dtype])
        out.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))
        return out

    def broadcast(self, x, root=0, timeout=None):
        """``x`` as it is on ``root``, on every rank.

        Raises on every rank if the ranks' tensors differ in size or dtype,
        since that means the ranks are not running the same program (e.g. a
        model built differently on one rank).
        """
        _check_not_xla("broadcast")
        if self.size == 1:
            return tf.identity(x)
        comm, rendezvous = self.comm, self._rendezvous

        def bcast(array):
            rendezvous.agree(rendezvous_lib.BROADCAST, array.dtype, [array.shape],
                             timeout=timeout)
            out = buffers.aligned_empty(array.shape, array.dtype)
            out[...] = array
            comm.Bcast([_bytes(out), MPI.BYTE], root=root)
            return (out,)

        (out,) = self._ordered_call("MPIBroadcast", bcast, [x], [x.dtype])
        out.set_shape(x.shape)
        return out


def _check_not_xla(name):
    # Checked even on one rank, so a program fails the same way at 1 and N ranks.
    if _tf_internal.in_xla_context():
        raise MPIStrategyError(
            f"mpi_strategy: the MPI collective {name} cannot be compiled by XLA. "
            "Remove jit_compile=True from the tf.function (for Keras: "
            "model.compile(..., jit_compile=False)); XLA can still compile "
            "functions that do not communicate, e.g. the model's forward pass.")


def _bytes(array):
    """A writable-if-possible uint8 view of a C-contiguous array (any dtype)."""
    return array.reshape(-1).view(np.uint8)
