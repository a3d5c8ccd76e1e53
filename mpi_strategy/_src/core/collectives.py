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

import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from mpi_strategy._src.core import (
    agreement as agreement_lib,
    buffers,
    collective_ops,
    protocol,
    ulfm,
)
from mpi_strategy._src.core.agreement import ErrorClass
from mpi_strategy._src.core.collective_ops.allreduce import REDUCTIONS
from mpi_strategy._src.core.collective_ops.base import Call
from mpi_strategy._src.core.collective_ops.reducescatter import row_split
from mpi_strategy._src.core.errors import MPIStrategyError, RanksLostError
from mpi_strategy._src.core.process import PROCESS
from mpi_strategy._src.core.protocol import Shape, State
from mpi_strategy._src.core.timeline import Timeline

Arrays = Sequence[np.ndarray]

__all__ = ["REDUCTIONS", "ArrayCollectives", "Arrays", "row_split"]


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

    @property
    def pool(self) -> buffers.BufferPool:
        """The pooled buffers the all-reduce packs into (``buffers.py``)."""
        return self._pool

    @property
    def mismatch_error(self) -> ErrorClass:
        """What a disagreement raises (eager)."""
        return self._mismatch_error

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

    # -- collectives (each declared in collective_ops/; named here for direct callers) --
    def allreduce(
        self,
        arrays: Arrays,
        op: str = "sum",
        shapes: Sequence[Shape] | None = None,
        timeout: float | None = None,
        token: int = 0,
    ) -> list[np.ndarray]:
        """``collective_ops.allreduce.numpy``: each of ``arrays`` (one dtype)
        reduced with ``op``; ``shapes``: what the agreement compares (default:
        the arrays' own)."""
        known = tuple(tuple(s) for s in shapes) if shapes else None
        p = Call(op=op, shapes=known, timeout=timeout)
        return collective_ops.ALLREDUCE.numpy(self, p, token, *arrays)

    def reducescatter(
        self, array: np.ndarray, op: str = "sum", timeout: float | None = None, token: int = 0
    ) -> np.ndarray:
        """``collective_ops.reducescatter.numpy``: this rank's rows of the reduction."""
        p = Call(op=op, timeout=timeout)
        return collective_ops.REDUCESCATTER.numpy(self, p, token, array)[0]

    def alltoallv(
        self, array: np.ndarray, splits: Sequence[int], timeout: float | None = None, token: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """``collective_ops.alltoallv.numpy``: (the rows received, in rank
        order; how many came from each rank)."""
        counts = np.asarray(splits, np.int64)
        out, received = collective_ops.ALLTOALLV.numpy(
            self, Call(timeout=timeout), token, array, counts
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
        collective_ops.BARRIER.numpy(self, Call(timeout=timeout), token)

    def allgather(
        self, arrays: Arrays, timeout: float | None = None, token: int = 0
    ) -> list[np.ndarray]:
        """``collective_ops.allgather.numpy``: each of ``arrays`` concatenated
        along axis 0 over the ranks, in rank order."""
        return collective_ops.ALLGATHER.numpy(self, Call(timeout=timeout), token, *arrays)

    def alltoall(
        self, array: np.ndarray, timeout: float | None = None, token: int = 0
    ) -> np.ndarray:
        """``collective_ops.alltoall.numpy``: row ``r`` of ``array`` goes to rank ``r``."""
        return collective_ops.ALLTOALL.numpy(self, Call(timeout=timeout), token, array)[0]

    def broadcast(
        self, array: np.ndarray, root: int = 0, timeout: float | None = None, token: int = 0
    ) -> np.ndarray:
        """``collective_ops.broadcast.numpy``: ``array`` as it is on ``root``."""
        p = Call(root=root, timeout=timeout)
        return collective_ops.BROADCAST.numpy(self, p, token, array)[0]
