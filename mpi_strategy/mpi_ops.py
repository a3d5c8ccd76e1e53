"""MPI collectives as TensorFlow ops that every rank issues in the same order.

MPI matches collectives by call order only. Each collective here is one
stateful ``tf.numpy_function`` that reads and writes a per-communicator
*ordering token* (a scalar resource variable). TensorFlow orders all ops that
touch the same resource in program order, across ``tf.cond``, ``tf.while_loop``
and nested function calls, so the collectives of one communicator run strictly
one after another, in the order the program issued them, on every rank. This
is the same device TensorFlow uses for its own collectives (an ordering token
passed to ``CollectiveReduceV2``).

Data crosses MPI as raw buffers, never as pickles.
"""

import numpy as np
import tensorflow as tf
from mpi4py import MPI

from mpi_strategy import _tf_internal
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

    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
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
    def allreduce_sum(self, x):
        """Element-wise sum of ``x`` over all ranks (every rank gets the sum)."""
        _check_not_xla("allreduce")
        if self.size == 1:
            return tf.identity(x)
        if x.dtype not in REDUCIBLE_DTYPES:
            raise MPIStrategyError(
                f"mpi_strategy: cannot sum dtype {x.dtype.name} with MPI; "
                f"supported: {[d.name for d in REDUCIBLE_DTYPES]} "
                "(float16/bfloat16 are summed in float32 by MPICrossDeviceOps).")
        comm = self.comm

        def allreduce(array):
            _check_same_on_all_ranks(
                comm, array.size, f"allreduce of {array.size} elements (shape {array.shape})",
                "Element-wise reductions need tensors of one shape on every rank; "
                "per-replica batches of different sizes can only be reduced along an "
                "axis (strategy.reduce(..., axis=0)) or gathered.")
            out = np.empty_like(array)
            comm.Allreduce(array, out, op=MPI.SUM)
            return (out,)

        (out,) = self._ordered_call("MPIAllreduce", allreduce, [x], [x.dtype])
        out.set_shape(x.shape)
        return out

    def allgather(self, x):
        """Concatenation along axis 0 of ``x`` from every rank, in rank order.

        Ranks may contribute different numbers of rows; the other dimensions
        and the dtype must agree (checked on every rank, so all ranks raise).
        """
        _check_not_xla("allgather")
        if self.size == 1:
            return tf.identity(x)
        comm, size = self.comm, self.size
        np_dtype = x.dtype.as_numpy_dtype

        def allgatherv(array):
            array = np.ascontiguousarray(array)
            rows = array.shape[0] if array.ndim else 1
            row_bytes = array.nbytes // rows if rows else _row_bytes(array)
            header = np.array([rows, row_bytes], np.int64)
            headers = np.empty((size, 2), np.int64)
            comm.Allgather(header, headers)
            if np.any(headers[:, 1] != row_bytes):
                raise MPIStrategyError(
                    "mpi_strategy: all_gather got rows of different sizes on "
                    f"different ranks (bytes per row by rank: {headers[:, 1].tolist()}, "
                    f"this is rank {comm.Get_rank()} with shape {array.shape}). "
                    "Every rank must gather tensors whose shapes agree except "
                    "along the gather axis.")
            counts = headers[:, 0] * row_bytes
            out = np.empty((int(headers[:, 0].sum()),) + array.shape[1:], np_dtype)
            comm.Allgatherv([_bytes(array), MPI.BYTE],
                            [_bytes(out), (counts.tolist(), None), MPI.BYTE])
            return (out,)

        (out,) = self._ordered_call("MPIAllgather", allgatherv, [x], [x.dtype])
        out.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))
        return out

    def broadcast(self, x, root=0):
        """``x`` as it is on ``root``, on every rank.

        Raises on every rank if the ranks' tensors differ in size, since that
        means the ranks are not running the same program (e.g. a model built
        differently on one rank).
        """
        _check_not_xla("broadcast")
        if self.size == 1:
            return tf.identity(x)
        comm = self.comm

        def bcast(array):
            _check_same_on_all_ranks(
                comm, array.nbytes,
                f"broadcast of {array.nbytes} bytes (shape {array.shape}, dtype {array.dtype})",
                "All ranks must create the same variables, in the same order, with "
                "the same shapes (build the model identically on every rank).")
            out = np.array(array, copy=True, order="C")
            comm.Bcast([_bytes(out), MPI.BYTE], root=root)
            return (out,)

        (out,) = self._ordered_call("MPIBroadcast", bcast, [x], [x.dtype])
        out.set_shape(x.shape)
        return out


def _check_same_on_all_ranks(comm, value, what, advice):
    """Raises the same error on every rank unless ``value`` agrees on all ranks.

    Costs one small Allgather; it turns a mismatch that MPI would report as
    "Message truncated" (or not at all) into an error that names the sizes.
    """
    everyone = np.empty(comm.Get_size(), np.int64)
    comm.Allgather(np.array([value], np.int64), everyone)
    if np.any(everyone != everyone[0]):
        raise MPIStrategyError(
            f"mpi_strategy: ranks disagree in an MPI collective. Rank {comm.Get_rank()}: "
            f"{what}; sizes by rank: {everyone.tolist()}. {advice}")


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


def _row_bytes(array):
    return int(np.prod(array.shape[1:], dtype=np.int64)) * array.itemsize
