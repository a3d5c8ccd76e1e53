"""The collectives on numpy arrays: agreement first, then the data (the engine).

``ArrayCollectives`` runs each collective of one communicator: the ranks agree on
it (``agreement.py``: a mismatch raises the same error on every rank, an
optional timeout names the ranks that never arrived), then the data moves as
raw buffers, never as pickles; small data rides in the agreement itself.
A rank lost under ULFM revokes the communicator and raises ``RanksLostError``.

It knows no framework: the tf.distribute binding (``distribute/ordered_comm.py``)
calls it from inside one ordered TF op per collective, and passes the
ordering token that the agreement compares. Every method is collective over
the communicator and returns the same values on every rank.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from mpi_strategy._src.core import agreement as agreement_lib, buffers, kinds, protocol, ulfm
from mpi_strategy._src.core.agreement import ErrorClass
from mpi_strategy._src.core.errors import MPIStrategyError, RanksLostError
from mpi_strategy._src.core.kinds import ALLTOALLV, BARRIER, REDUCESCATTER
from mpi_strategy._src.core.process import PROCESS
from mpi_strategy._src.core.protocol import Field, Shape, State
from mpi_strategy._src.core.timeline import Timeline
from mpi_strategy._src.core.wire import as_bytes, concat_bytes, split_gathered

Arrays = Sequence[np.ndarray]

# op name -> (the agreement's kind, the MPI op, the numpy ufunc for carried data)
REDUCTIONS: dict[str, tuple[kinds.Kind, MPI.Op, np.ufunc]] = {
    "sum": (kinds.ALLREDUCE, MPI.SUM, np.add),
    "min": (kinds.ALLREDUCE_MIN, MPI.MIN, np.minimum),
    "max": (kinds.ALLREDUCE_MAX, MPI.MAX, np.maximum),
    "product": (kinds.ALLREDUCE_PRODUCT, MPI.PROD, np.multiply),
}


class ArrayCollectives:
    """The collectives of one communicator, on numpy arrays.

    Collective over ``comm``: every rank of it creates its ``ArrayCollectives`` at
    the same point. The data moves on one duplicate of ``comm`` (``comm``
    here) and the agreement runs on another (``agreement_comm``), both made
    here and freed with this object, so that neither matches the program's own
    MPI calls on ``comm``, nor those of another ``ArrayCollectives`` of the same
    ``comm`` (an MPIStrategy's and ``hvd.init``'s on ``COMM_WORLD``), nor each other.

    ``name_missing_ranks``: make timeouts name the ranks that never arrived
    (costs a few bytes of point-to-point messages per collective when a
    timeout is used). ``mismatch_error`` / ``timeout_error``: see ``Agreement``.
    """

    def __init__(
        self,
        comm: MPI.Intracomm,
        name_missing_ranks: bool = False,
        mismatch_error: ErrorClass = MPIStrategyError,
        timeout_error: ErrorClass = MPIStrategyError,
    ) -> None:
        self.comm = comm.Dup()
        self.agreement_comm = comm.Dup()  # (in the same order on every rank)
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.agreement = agreement_lib.Agreement(
            self.agreement_comm, name_missing_ranks, mismatch_error, timeout_error
        )
        # Each freed with its user. Not at exit: the end-of-program meeting
        # may still use them, and MPI_Finalize frees them anyway.
        weakref.finalize(self, self.comm.Free).atexit = False
        weakref.finalize(self.agreement, self.agreement_comm.Free).atexit = False
        self.agreement.state[State.DATA_COMM] = protocol.as_int64(self.comm.handle)
        self.number = next(PROCESS.communicator_numbers)  # its name in the timeline
        self.failed = False  # a rank died (see RanksLostError)
        self._retired: Callable[[], Exception] | None = None
        self._mismatch_error = mismatch_error
        self._pool = buffers.BufferPool()

    def guarded(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, with a lost rank (an MPI process failure) turned into
        ``RanksLostError`` after revoking the communicator."""

        def call(*args: Any) -> Any:
            if self._retired is not None:
                raise self._retired()
            try:
                return fn(*args)
            except MPI.Exception as error:
                if not ulfm.is_process_failure(error):
                    raise
                raise self.ranks_lost(error) from error

        return call

    def retire(self, error: Callable[[], Exception]) -> None:
        """Makes every later collective raise ``error()`` (a communicator that
        a recovery replaced, still reachable from code traced before it)."""
        self._retired = error
        self.agreement.state[State.BLOCKED] = 1

    def ranks_lost(self, error: MPI.Exception) -> RanksLostError:
        """Marks this communicator as failed, revokes it (ranks in another
        collective of it raise too) and returns the error to raise."""
        self.failed = True
        self.revoke()
        return RanksLostError(
            f"mpi_strategy: a rank of this {self.size}-rank communicator died "
            f"({error.Get_error_string()}); the survivors' collectives were revoked. "
            "mpi_strategy.elastic.run continues training on the survivors; without it "
            "the job ends (resume from the last checkpoint)."
        )

    def revoke(self) -> None:
        """Revokes every communicator these collectives call MPI on (the data's,
        the agreement's, the announcements'): a survivor waiting in any of them
        leaves it (ULFM)."""
        for comm in (self.comm, *self.agreement.communicators()):
            ulfm.revoke(comm)

    def timed(self, fn: Callable[..., Any], name: str, trace: Timeline) -> Callable[..., Any]:
        """``fn(token, *arrays)``, recording each call in the timeline ``trace``."""
        agreement = self.agreement

        def timed(token: int, *arrays: np.ndarray) -> Any:
            start = time.perf_counter()
            outs = fn(token, *arrays)
            self.record(
                trace,
                name,
                (start, agreement.agreed_at, time.perf_counter()),
                sum(a.nbytes for a in arrays),
                len(arrays),
            )
            return outs

        return timed

    def record(
        self,
        trace: Timeline,
        name: str,
        times: tuple[float, float, float],
        nbytes: int,
        tensors: int,
    ) -> None:
        """Records in ``trace`` this communicator's last collective, the op
        ``name``: ``times`` (entered, agreed, done; ``time.perf_counter()``),
        the bytes and tensors it was given (also the native kernels')."""
        comm = (self.number, f"MPI communicator {self.number} ({self.size} ranks)")
        trace.collective(name, comm, *times, nbytes, tensors, self.agreement.seq)

    # -- collectives -----------------------------------------------------------
    def allreduce(
        self,
        arrays: Arrays,
        op: str = "sum",
        shapes: Sequence[Shape] | None = None,
        timeout: float | None = None,
        token: int = 0,
    ) -> list[np.ndarray]:
        """Reduces each of ``arrays`` (one dtype) element-wise over the ranks
        with ``op`` (one of ``REDUCTIONS``), in one MPI call.

        The arrays are copied into one pooled buffer, reduced in place and
        handed back as aligned views of it (``buffers.py``). ``shapes``: the
        shapes the agreement compares when the caller concatenated the
        tensors (default: the arrays' own). Small data is reduced from the
        agreement's records, in rank order, alike on every rank.
        """
        kind, mpi_op, ufunc = REDUCTIONS[op]
        buffer, outs = buffers.pack(arrays, self._pool)
        _, carried = self.agreement.agree_carrying(
            as_bytes(buffer),
            kind,
            arrays[0].dtype,
            shapes or [a.shape for a in arrays],
            timeout=timeout,
            token=token,
        )
        if carried is None:
            self.comm.Allreduce(MPI.IN_PLACE, buffer, op=mpi_op)
        else:
            every_rank = carried[:, : buffer.nbytes].view(buffer.dtype)
            buffer[...] = every_rank[0]
            for row in every_rank[1:]:
                ufunc(buffer, row, out=buffer)
        return outs

    def reducescatter(
        self,
        array: np.ndarray,
        op: str = "sum",
        timeout: float | None = None,
        token: int = 0,
    ) -> np.ndarray:
        """``array`` (one shape and dtype on every rank, at least one axis)
        reduced with ``op``, then cut along axis 0: rank ``r`` gets the rows
        ``row_split(len(array), size)[r]`` (the first ``len % size`` ranks one
        row more than the others)."""
        _, mpi_op, _ = REDUCTIONS[op]
        array = np.ascontiguousarray(array)
        self.agreement.agree(
            REDUCESCATTER, array.dtype, [array.shape], timeout=timeout, tag=op, token=token
        )
        row = math.prod(array.shape[1:])
        counts = [n * row for n in row_split(array.shape[0], self.size)]
        rows = row_split(array.shape[0], self.size)[self.rank]
        out = buffers.aligned_empty((rows, *array.shape[1:]), array.dtype)
        if array.size:
            self.comm.Reduce_scatter(array.reshape(-1), out.reshape(-1), counts, op=mpi_op)
        return out

    def alltoallv(
        self, array: np.ndarray, splits: Sequence[int], timeout: float | None = None, token: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``splits[0]`` of ``array`` go to rank 0, the next ``splits[1]``
        to rank 1, and so on; returns (the rows received, in rank order; how
        many came from each rank). Shapes beyond axis 0 and the dtype must agree."""
        array = np.ascontiguousarray(array)
        counts = np.asarray(splits, np.int64).reshape(-1)
        rows = array.shape[0] if array.ndim else -1
        # This rank's counts, then whether they fit its array: every rank
        # learns every rank's, so bad counts raise on every rank.
        sent = np.zeros(self.size + 1, np.int64)
        sent[: min(self.size, counts.size)] = counts[: self.size]
        sent[-1] = counts.size == self.size and bool((counts >= 0).all()) and counts.sum() == rows
        _, carried = self.agreement.agree_carrying(
            as_bytes(sent),
            ALLTOALLV,
            array.dtype,
            [array.shape[1:]],
            timeout=timeout,
            token=token,
        )
        if carried is None:
            matrix = np.empty((self.size, self.size + 1), np.int64)
            self.comm.Allgather([sent, MPI.INT64_T], [matrix, MPI.INT64_T])
        else:
            matrix = carried[:, : sent.nbytes].copy().view(np.int64)
        if not matrix[:, -1].all():
            raise self.bad_splits(matrix, counts.tolist(), rows)
        matrix = matrix[:, :-1]
        sent = sent[:-1]
        received = matrix[:, self.rank].copy()
        row_bytes = math.prod(array.shape[1:]) * array.itemsize
        out = buffers.aligned_empty((int(received.sum()), *array.shape[1:]), array.dtype)
        send_counts, recv_counts = sent * row_bytes, received * row_bytes
        self.comm.Alltoallv(
            [as_bytes(array), (send_counts.tolist(), _starts(send_counts)), MPI.BYTE],
            [as_bytes(out), (recv_counts.tolist(), _starts(recv_counts)), MPI.BYTE],
        )
        return out, received

    def bad_splits(self, matrix: np.ndarray, counts: list[int], rows: int) -> Exception:
        """The error of an alltoall whose splits do not cut some rank's tensor:
        ``matrix``, every rank's splits and whether they fit (its last column,
        0: not); ``counts`` and ``rows``, this rank's splits and rows (-1: a scalar)."""
        bad = np.flatnonzero(matrix[:, -1] == 0).tolist()
        return self._mismatch_error(
            f"mpi_strategy: alltoall: the splits of rank(s) {bad} do not cut their "
            f"tensor: each rank needs {self.size} non-negative splits that sum to the "
            f"length of its tensor's first dimension (this is rank {self.rank}: splits "
            f"{counts}, {rows} rows)."
        )

    def barrier(self, timeout: float | None = None, token: int | None = None) -> None:
        """Returns once every rank has called it (with a timeout, naming the late ranks)."""
        self.agreement.agree(BARRIER, np.uint8, [], timeout=timeout, token=token)

    def allgather(
        self, arrays: Arrays, timeout: float | None = None, token: int = 0
    ) -> list[np.ndarray]:
        """Each of ``arrays`` concatenated along axis 0 over the ranks, in rank
        order (any dtypes; row counts may differ per rank), in one Allgatherv
        of bytes: each rank sends its row counts, then every array's bytes."""
        arrays = [np.ascontiguousarray(a) for a in arrays]
        rows = np.array([a.shape[0] if a.ndim else 1 for a in arrays], np.int64)
        mine = concat_bytes([rows, *arrays])
        everyone, carried = self.agreement.agree_carrying(
            mine,
            kinds.ALLGATHER,
            [a.dtype for a in arrays],
            [a.shape[1:] for a in arrays],
            rows=int(rows.sum()),
            timeout=timeout,
            token=token,
        )
        counts = everyone[:, Field.BYTES]
        if carried is None:
            received = buffers.aligned_empty((int(counts.sum()),), np.uint8)
            self.comm.Allgatherv(mine, [received, (counts.tolist(), None), MPI.BYTE])
        else:
            received = np.concatenate([row[:n] for row, n in zip(carried, counts)])
        return split_gathered(received, counts, arrays)

    def alltoall(
        self, array: np.ndarray, timeout: float | None = None, token: int = 0
    ) -> np.ndarray:
        """Row ``r`` of ``array`` goes to rank ``r``; row ``r`` of the result
        came from rank ``r``. ``array`` has one row per rank."""
        if array.ndim == 0 or array.shape[0] != self.size:
            raise self._mismatch_error(
                f"mpi_strategy: alltoall needs one row per rank ({self.size}), got "
                f"shape {array.shape}."
            )
        array = np.ascontiguousarray(array)
        self.agreement.agree(
            kinds.ALLTOALL, array.dtype, [array.shape], timeout=timeout, token=token
        )
        out = buffers.aligned_empty(array.shape, array.dtype)
        self.comm.Alltoall([as_bytes(array), MPI.BYTE], [as_bytes(out), MPI.BYTE])
        return out

    def broadcast(
        self, array: np.ndarray, root: int = 0, timeout: float | None = None, token: int = 0
    ) -> np.ndarray:
        """``array`` as it is on ``root``; ranks whose arrays differ in size or
        dtype raise (they are not running the same program)."""
        out = buffers.aligned_empty(array.shape, array.dtype)
        out[...] = array
        _, carried = self.agreement.agree_carrying(
            as_bytes(out),
            kinds.BROADCAST,
            array.dtype,
            [array.shape],
            timeout=timeout,
            token=token,
            tag=f"root {root}",
        )
        if carried is None:
            self.comm.Bcast([as_bytes(out), MPI.BYTE], root=root)
        else:
            as_bytes(out)[...] = carried[root, : out.nbytes]
        return out


def row_split(rows: int, parts: int) -> list[int]:
    """``rows`` cut into ``parts`` as evenly as possible, the larger pieces first."""
    return [rows // parts + (1 if r < rows % parts else 0) for r in range(parts)]


def _starts(counts: np.ndarray) -> list[int]:
    return (np.cumsum(counts) - counts).tolist()
