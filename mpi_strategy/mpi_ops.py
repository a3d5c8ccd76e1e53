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
optional timeout names the ranks that never arrived. These errors are raised
in the op's Python function, so inside ``tf.function`` TensorFlow hands them
to the caller as ``tf.errors`` classes (``errors.py`` says which). Data
crosses MPI as raw buffers, never as pickles.
"""

import itertools
import math
import time
import weakref
import zlib

import numpy as np
import tensorflow as tf
from mpi4py import MPI

from mpi_strategy import _tf_internal
from mpi_strategy import buffers
from mpi_strategy import rendezvous as rendezvous_lib
from mpi_strategy import timeline as timeline_lib
from mpi_strategy.errors import CollectiveMismatchError, MPIStrategyError, RanksLostError
from mpi_strategy.failure import is_process_failure

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
        """Collective over ``comm``: every rank of it creates its OrderedComm
        at the same point. The collectives run on a duplicate of ``comm``
        (``comm.Dup()``, freed with this object), so that they never match
        the program's own MPI calls on ``comm``, nor those of another
        OrderedComm of the same ``comm``.

        ``name_missing_ranks``: make timeouts name the ranks that never
        arrived (costs a few bytes of point-to-point messages per collective
        when a timeout is used)."""
        self.comm = comm.Dup()
        # Not at exit: the end-of-program meeting (write_point.py) may still
        # use it, and MPI_Finalize frees it anyway.
        weakref.finalize(self, self.comm.Free).atexit = False
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.rendezvous = rendezvous_lib.Rendezvous(comm, name_missing_ranks)
        self._number = next(_numbers)  # names this communicator in the timeline
        self.failed = False  # a rank died (see RanksLostError)
        self._pool = buffers.BufferPool()
        # The token must be a plain (non-distributed) variable: create it
        # outside any tf.function, on the host.
        with tf.init_scope(), tf.device("/device:CPU:0"):
            self._token = tf.Variable(
                np.int64(0), trainable=False, name="mpi_ordering_token",
                synchronization=tf.VariableSynchronization.NONE)

    # -- the one place a TF op calls MPI -------------------------------------
    def _ordered_call(self, name, fn, inputs, output_dtypes):
        """Runs ``fn(token, *numpy_inputs) -> list of arrays`` as one ordered op.

        ``token`` (an int, the same on every rank) goes into the collective's
        signature, so that ranks whose earlier constants differed raise.
        """
        trace = timeline_lib.current(self.rank)
        if trace is not None:
            fn = self._timed(fn, name, trace)

        def with_token(token, *arrays):
            try:
                return [token + 1] + list(fn(int(token), *arrays))
            except MPI.Exception as error:
                if not is_process_failure(error):
                    raise
                raise self._ranks_lost(error) from error

        with tf.device("/device:CPU:0"):
            token = self._token.read_value()
            outputs = tf.numpy_function(
                with_token, [token] + list(inputs), [tf.int64] + list(output_dtypes),
                stateful=True, name=name)
            self._token.assign(outputs[0])
        return outputs[1:]

    def _ranks_lost(self, error):
        """Marks this communicator as failed, revokes it (ranks in another
        collective of it raise too) and returns the error to raise."""
        self.failed = True
        try:
            self.comm.Revoke()
        except MPI.Exception:
            pass  # already revoked by another rank
        return RanksLostError(
            f"mpi_strategy: a rank of this {self.size}-rank communicator died "
            f"({error.Get_error_string()}); the survivors' collectives were revoked. "
            "mpi_strategy.elastic.run continues training on the survivors; without it "
            "the job ends (resume from the last checkpoint).")

    def _timed(self, fn, name, trace):
        """``fn``, recording each call in the timeline ``trace``."""
        rendezvous = self.rendezvous
        comm = (self._number, f"MPI communicator {self._number} ({self.size} ranks)")

        def timed(token, *arrays):
            start = time.perf_counter()
            outs = fn(token, *arrays)
            trace.collective(name, comm, start, rendezvous.agreed_at, time.perf_counter(),
                             sum(a.nbytes for a in arrays), len(arrays), rendezvous.seq)
            return outs
        return timed

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
        Many small tensors (a small model's gradients) are concatenated by
        TensorFlow first: each tensor that crosses into Python costs several
        microseconds, more than copying a few hundred kB.
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
        if len(tensors) > 1 and _small_and_static(tensors):
            shapes = [tuple(t.shape) for t in tensors]
            flat = tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)
            (summed,) = self._ordered_call("MPIAllreduce", self._allreduce(shapes, timeout),
                                           [flat], [flat.dtype])
            parts = tf.split(summed, [math.prod(shape) for shape in shapes])
            return [tf.reshape(part, shape) for part, shape in zip(parts, shapes)]
        outs = self._ordered_call("MPIAllreduce", self._allreduce(None, timeout), tensors,
                                  [t.dtype for t in tensors])
        for out, t in zip(outs, tensors):
            out.set_shape(t.shape)
        return outs

    def _allreduce(self, shapes, timeout):
        """The numpy function of an allreduce; ``shapes``: the tensors' shapes when
        they arrive concatenated (the agreement compares these), else None."""
        comm, rendezvous, pool = self.comm, self.rendezvous, self._pool

        def allreduce(token, *arrays):
            buffer, outs = buffers.pack(arrays, pool)
            _, carried = rendezvous.agree_carrying(
                _bytes(buffer), rendezvous_lib.ALLREDUCE, arrays[0].dtype,
                shapes or [a.shape for a in arrays], timeout=timeout, token=token)
            if carried is None:
                comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
            else:  # small: summed here, in rank order, alike on every rank
                every_rank = carried[:, :buffer.nbytes].view(buffer.dtype)
                buffer[...] = every_rank[0]
                for row in every_rank[1:]:
                    buffer += row
            return outs
        return allreduce

    def allgather(self, x, timeout=None):
        """Concatenation along axis 0 of ``x`` from every rank, in rank order.

        Ranks may contribute different numbers of rows; the other dimensions
        and the dtype must agree (checked on every rank, so all ranks raise).
        """
        return self.allgather_many([x], timeout)[0]

    def allgather_many(self, tensors, timeout=None):
        """``allgather`` of each of ``tensors``, in one MPI call.

        The tensors may differ in dtype and shape; each is concatenated along
        axis 0 over the ranks, in rank order, and may have a different number
        of rows on each rank. One ``Allgatherv`` of bytes carries them all:
        each rank sends its row counts, then every tensor's bytes.
        """
        _check_not_xla("allgather")
        if self.size == 1:
            return [tf.identity(x) for x in tensors]
        comm, rendezvous = self.comm, self.rendezvous

        def allgatherv(token, *arrays):
            arrays = [np.ascontiguousarray(a) for a in arrays]
            rows = np.array([a.shape[0] if a.ndim else 1 for a in arrays], np.int64)
            mine = _concat_bytes([rows] + arrays)
            everyone, carried = rendezvous.agree_carrying(
                mine, rendezvous_lib.ALLGATHER, [a.dtype for a in arrays],
                [a.shape[1:] for a in arrays], rows=int(rows.sum()), timeout=timeout,
                token=token)
            counts = everyone[:, -1]
            if carried is None:
                received = buffers.aligned_empty((int(counts.sum()),), np.uint8)
                comm.Allgatherv(mine, [received, (counts.tolist(), None), MPI.BYTE])
            else:
                received = np.concatenate([row[:n] for row, n in zip(carried, counts)])
            return _split_gathered(received, counts, arrays)

        outs = self._ordered_call("MPIAllgather", allgatherv, tensors,
                                  [x.dtype for x in tensors])
        for out, x in zip(outs, tensors):
            out.set_shape(tf.TensorShape([None]).concatenate(x.shape[1:]))
        return outs

    def alltoall(self, x, timeout=None):
        """Row ``r`` of ``x`` goes to rank ``r``: the result's row ``r`` is what
        rank ``r`` sent to this rank. ``x`` has ``size`` rows, of the same
        shape and dtype on every rank.
        """
        _check_not_xla("alltoall")
        if self.size == 1:
            return tf.identity(x)
        comm, rendezvous = self.comm, self.rendezvous

        def alltoall(token, array):
            if array.ndim == 0 or array.shape[0] != self.size:
                raise CollectiveMismatchError(
                    f"mpi_strategy: alltoall needs one row per rank ({self.size}), got "
                    f"shape {array.shape}.")
            array = np.ascontiguousarray(array)
            rendezvous.agree(rendezvous_lib.ALLTOALL, array.dtype, [array.shape],
                             timeout=timeout, token=token)
            out = buffers.aligned_empty(array.shape, array.dtype)
            comm.Alltoall([_bytes(array), MPI.BYTE], [_bytes(out), MPI.BYTE])
            return (out,)

        (out,) = self._ordered_call("MPIAlltoall", alltoall, [x], [x.dtype])
        out.set_shape(x.shape)
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
        comm, rendezvous = self.comm, self.rendezvous

        def bcast(token, array):
            out = buffers.aligned_empty(array.shape, array.dtype)
            out[...] = array
            _, carried = rendezvous.agree_carrying(
                _bytes(out), rendezvous_lib.BROADCAST, array.dtype, [array.shape],
                timeout=timeout, token=token)
            if carried is None:
                comm.Bcast([_bytes(out), MPI.BYTE], root=root)
            else:
                _bytes(out)[...] = carried[root, :out.nbytes]
            return (out,)

        (out,) = self._ordered_call("MPIBroadcast", bcast, [x], [x.dtype])
        out.set_shape(x.shape)
        return out


    def check_same_constants(self, arrays):
        """Checks, at the next collective, that ``arrays`` (constants of the
        program, numpy arrays) are the same on every rank, without sending them.

        The ordering token advances by a hash of their values; the tokens are
        part of the next collective's signature, where ranks that held
        different constants raise ``CollectiveMismatchError``.
        """
        if self.size == 1 or not arrays:
            return
        digest = 0
        for array in arrays:
            digest = zlib.crc32(f"{array.dtype}{array.shape}".encode() + array.tobytes(), digest)
        with tf.device("/device:CPU:0"):
            self._token.assign_add(digest & _CONSTANT_HASH_MASK)


# 24 bits per constant: the token (an int64) does not overflow in 2^39 steps.
_CONSTANT_HASH_MASK = (1 << 24) - 1


_numbers = itertools.count()


# Up to this many bytes, TensorFlow concatenates many tensors into one before
# they cross into Python (see allreduce_sum_packed).
_CONCAT_IN_GRAPH_BYTES = 256 * 1024


def _small_and_static(tensors):
    if not all(t.shape.is_fully_defined() for t in tensors):
        return False
    return sum(t.shape.num_elements() * t.dtype.size for t in tensors) <= _CONCAT_IN_GRAPH_BYTES


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


def _padded(nbytes):
    return -(-nbytes // 8) * 8  # every piece starts 8-byte aligned


def _concat_bytes(arrays):
    """The bytes of ``arrays`` back to back, each piece padded to 8 bytes."""
    sizes = [a.nbytes for a in arrays]
    out = np.zeros(sum(_padded(n) for n in sizes), np.uint8)
    offset = 0
    for a, n in zip(arrays, sizes):
        out[offset:offset + n] = _bytes(a)
        offset += _padded(n)
    return out


def _split_gathered(received, counts, arrays):
    """Every rank's pieces of ``received`` (laid out by ``_concat_bytes``),
    concatenated per tensor in rank order; ``arrays`` give dtypes and row shapes.

    The results are aligned views of one new buffer (TensorFlow adopts them
    without a copy). A tensor with as many bytes from every rank at the same
    place in each rank's part (the usual case: equal batches) moves in one
    strided copy.
    """
    k = len(arrays)
    row_bytes = np.array([math.prod(a.shape[1:]) * a.itemsize for a in arrays], np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rows = np.stack([received[s:s + 8 * k].view(np.int64) for s in starts.tolist()])
    nbytes = rows * row_bytes  # [rank, tensor]
    padded = -(-nbytes // 8) * 8
    offsets = (starts + _padded(8 * k))[:, None] + np.cumsum(padded, axis=1) - padded
    totals = nbytes.sum(axis=0)
    slots = -(-totals // buffers.ALIGN_BYTES) * buffers.ALIGN_BYTES
    out = buffers.aligned_empty((int(slots.sum()),), np.uint8)
    p = len(counts)
    # One strided copy per tensor where every rank's piece has the same size
    # and place in its part (equal batches); else one copy per rank.
    strided = (np.all(counts == counts[0]) & np.all(nbytes == nbytes[0], axis=0)
               & np.all(offsets - starts[:, None] == offsets[0], axis=0)).tolist()
    blocks = received.reshape(p, -1) if any(strided) else None
    outs = []
    for i, (a, at, total, one, first, n_rows) in enumerate(zip(
            arrays, (np.cumsum(slots) - slots).tolist(), totals.tolist(),
            nbytes[0].tolist(), offsets[0].tolist(), rows.sum(axis=0).tolist())):
        flat = out[at:at + total]
        if strided[i]:
            if one:
                flat.reshape(p, one)[...] = blocks[:, first:first + one]
        else:
            done = 0
            for offset, size in zip(offsets[:, i].tolist(), nbytes[:, i].tolist()):
                flat[done:done + size] = received[offset:offset + size]
                done += size
        outs.append(flat.view(a.dtype).reshape((n_rows,) + a.shape[1:]))
    return outs
