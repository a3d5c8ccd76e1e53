"""The collectives on numpy arrays: agreement first, then the data (the engine).

``Collectives`` runs each collective of one communicator: the ranks agree on
it (``rendezvous.py``: a mismatch raises the same error on every rank, an
optional timeout names the ranks that never arrived), then the data moves as
raw buffers, never as pickles; small data rides in the agreement itself.
A rank lost under ULFM revokes the communicator and raises ``RanksLostError``.

It knows no framework: the tf.distribute binding (``distribute/ops.py``)
calls it from inside one ordered TF op per collective, and passes the
ordering token that the agreement compares. Every method is collective over
the communicator and returns the same values on every rank.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from mpi_strategy._src.core import buffers, rendezvous as rendezvous_lib, ulfm
from mpi_strategy._src.core.errors import MPIStrategyError, RanksLostError
from mpi_strategy._src.core.rendezvous import ErrorClass, Shape
from mpi_strategy._src.core.timeline import Timeline
from mpi_strategy._src.core.wire import as_bytes, concat_bytes, split_gathered

Arrays = Sequence[np.ndarray]
_numbers = itertools.count()  # names each communicator in the timeline


class Collectives:
    """The collectives of one communicator, on numpy arrays.

    Collective over ``comm``: every rank of it creates its ``Collectives`` at
    the same point. They run on a duplicate of ``comm`` (``comm.Dup()``, freed
    with this object), so that they never match the program's own MPI calls on
    ``comm``, nor those of another ``Collectives`` of the same ``comm``.

    ``name_missing_ranks``: make timeouts name the ranks that never arrived
    (costs a few bytes of point-to-point messages per collective when a
    timeout is used). ``mismatch_error`` / ``timeout_error``: see ``Rendezvous``.
    """

    def __init__(
        self,
        comm: MPI.Intracomm,
        name_missing_ranks: bool = False,
        mismatch_error: ErrorClass = MPIStrategyError,
        timeout_error: ErrorClass = MPIStrategyError,
    ) -> None:
        self.comm = comm.Dup()
        # Not at exit: the end-of-program meeting may still use it, and
        # MPI_Finalize frees it anyway.
        weakref.finalize(self, self.comm.Free).atexit = False
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.rendezvous = rendezvous_lib.Rendezvous(
            comm, name_missing_ranks, mismatch_error, timeout_error
        )
        self.number = next(_numbers)
        self.failed = False  # a rank died (see RanksLostError)
        self._mismatch_error = mismatch_error
        self._pool = buffers.BufferPool()

    def guarded(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, with a lost rank (an MPI process failure) turned into
        ``RanksLostError`` after revoking the communicator."""

        def call(*args: Any) -> Any:
            try:
                return fn(*args)
            except MPI.Exception as error:
                if not ulfm.is_process_failure(error):
                    raise
                raise self.ranks_lost(error) from error

        return call

    def ranks_lost(self, error: MPI.Exception) -> RanksLostError:
        """Marks this communicator as failed, revokes it (ranks in another
        collective of it raise too) and returns the error to raise."""
        self.failed = True
        ulfm.revoke(self.comm)
        return RanksLostError(
            f"mpi_strategy: a rank of this {self.size}-rank communicator died "
            f"({error.Get_error_string()}); the survivors' collectives were revoked. "
            "mpi_strategy.elastic.run continues training on the survivors; without it "
            "the job ends (resume from the last checkpoint)."
        )

    def timed(self, fn: Callable[..., Any], name: str, trace: Timeline) -> Callable[..., Any]:
        """``fn(token, *arrays)``, recording each call in the timeline ``trace``."""
        rendezvous = self.rendezvous
        comm = (self.number, f"MPI communicator {self.number} ({self.size} ranks)")

        def timed(token: int, *arrays: np.ndarray) -> Any:
            start = time.perf_counter()
            outs = fn(token, *arrays)
            trace.collective(
                name,
                comm,
                start,
                rendezvous.agreed_at,
                time.perf_counter(),
                sum(a.nbytes for a in arrays),
                len(arrays),
                rendezvous.seq,
            )
            return outs

        return timed

    # -- collectives -----------------------------------------------------------
    def allreduce_sum(
        self,
        arrays: Arrays,
        shapes: Sequence[Shape] | None = None,
        timeout: float | None = None,
        token: int = 0,
    ) -> list[np.ndarray]:
        """Sums each of ``arrays`` (one dtype) over the ranks, in one MPI call.

        The arrays are copied into one pooled buffer, summed in place and
        handed back as aligned views of it (``buffers.py``). ``shapes``: the
        shapes the agreement compares when the caller concatenated the
        tensors (default: the arrays' own). Small data is summed from the
        agreement's records, in rank order, alike on every rank.
        """
        buffer, outs = buffers.pack(arrays, self._pool)
        _, carried = self.rendezvous.agree_carrying(
            as_bytes(buffer),
            rendezvous_lib.ALLREDUCE,
            arrays[0].dtype,
            shapes or [a.shape for a in arrays],
            timeout=timeout,
            token=token,
        )
        if carried is None:
            self.comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
        else:
            every_rank = carried[:, : buffer.nbytes].view(buffer.dtype)
            buffer[...] = every_rank[0]
            for row in every_rank[1:]:
                buffer += row
        return outs

    def allgather(
        self, arrays: Arrays, timeout: float | None = None, token: int = 0
    ) -> list[np.ndarray]:
        """Each of ``arrays`` concatenated along axis 0 over the ranks, in rank
        order (any dtypes; row counts may differ per rank), in one Allgatherv
        of bytes: each rank sends its row counts, then every array's bytes."""
        arrays = [np.ascontiguousarray(a) for a in arrays]
        rows = np.array([a.shape[0] if a.ndim else 1 for a in arrays], np.int64)
        mine = concat_bytes([rows, *arrays])
        everyone, carried = self.rendezvous.agree_carrying(
            mine,
            rendezvous_lib.ALLGATHER,
            [a.dtype for a in arrays],
            [a.shape[1:] for a in arrays],
            rows=int(rows.sum()),
            timeout=timeout,
            token=token,
        )
        counts = everyone[:, -1]
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
        self.rendezvous.agree(
            rendezvous_lib.ALLTOALL, array.dtype, [array.shape], timeout=timeout, token=token
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
        _, carried = self.rendezvous.agree_carrying(
            as_bytes(out),
            rendezvous_lib.BROADCAST,
            array.dtype,
            [array.shape],
            timeout=timeout,
            token=token,
        )
        if carried is None:
            self.comm.Bcast([as_bytes(out), MPI.BYTE], root=root)
        else:
            as_bytes(out)[...] = carried[root, : out.nbytes]
        return out
