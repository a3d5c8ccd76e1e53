"""A rank that dies must take the job with it, not leave the others waiting.

MPI collectives wait for every rank. A Python exception that ends one rank's
program would leave the other ranks blocked in their next collective until the
batch system's time limit. Once an MPIStrategy spans several processes, an
uncaught exception prints its traceback tagged with the rank and aborts the
whole MPI job (as ``python -m mpi4py`` does), so it fails in seconds.

Launched with ULFM (``mpirun --with-ft ulfm``, for elastic training), the rank
leaves differently: MPI_Abort called by several ranks at once can hang Open
MPI 5.0's launcher, and a rank that exits with a non-zero status is not
reported to the others (they would wait for it), while one killed by a signal
does not count in ``mpirun``'s exit status. See ``_leave_under_ulfm``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Protocol

from mpi4py import MPI

from mpi_strategy._src.core.errors import RanksLostError, TooFewRanksError
from mpi_strategy._src.core.process import PROCESS
from mpi_strategy._src.core.ulfm import (
    is_process_failure,
    is_replacement,
    known_dead,
    ulfm_launch,
)

# Under ULFM, how long the highest rank alive that dies of its own error waits
# to learn that the lower ranks died too (then it ends with status 1, see
# ``_leave_under_ulfm``). Measured: 60-270 ms with 2 or 3 TensorFlow ranks
# raising at once on 2 cores (the lower ranks die at once); a busy machine
# gets 20 times that.
_LOWER_RANKS_WAIT_S = 5.0


class MayFail(Protocol):
    """A communicator's collectives (``ArrayCollectives``, ``OrderedComm``)."""

    @property
    def failed(self) -> bool: ...


def lost_mark() -> int:
    """How many ``RanksLostError`` this process has made so far: the ``since``
    of ``ranks_were_lost``, taken before the code whose errors it judges."""
    return PROCESS.ranks_lost


def ranks_were_lost(
    error: BaseException, comms: Iterable[MayFail] = (), since: int | None = None
) -> bool:
    """True if ``error`` comes from a lost rank (the one rule of both elastic
    faces): a ``RanksLostError``; an MPI process failure (ULFM), also of the
    program's own MPI calls; any error once a communicator of ``comms`` saw
    a rank die (``failed``); or any error once this process made a
    ``RanksLostError`` after ``lost_mark()`` returned ``since``, of any
    communicator: inside a ``tf.function`` TensorFlow replaces the exception
    by a ``tf.errors`` class, on either engine, so its class is lost but not
    the count."""
    return (
        isinstance(error, RanksLostError)
        or is_process_failure(error)
        or any(comm.failed for comm in comms)
        or (since is not None and PROCESS.ranks_lost > since)
    )


def arm(comm: MPI.Comm) -> None:
    """Called with every strategy's communicator: once one spans several ranks
    (or this process replaces a lost rank, alone in its world until it joins:
    the survivors must learn of its death), an uncaught exception ends the job."""
    if comm.Get_size() > 1 or is_replacement():
        PROCESS.failure_armed = True
        PROCESS.failure_comm = comm


def armed() -> bool:
    """True once an uncaught exception must end the whole job (see ``arm``)."""
    return PROCESS.failure_armed


def aborting() -> bool:
    """True once this process has started to abort the job (an uncaught exception)."""
    return PROCESS.aborting


def end_the_job(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    """The uncaught exception's traceback, tagged with the rank, then the end
    of the job (``MPI_Abort``; under ULFM see ``_leave_under_ulfm``). A
    ``KeyboardInterrupt`` (Ctrl-C) ends it like any other exception."""
    PROCESS.aborting = True  # MPICH's Abort may still run exit handlers
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    # One write, so that launchers that tag lines with the rank keep it whole.
    # TensorFlow's messages span many lines; the traceback below has them all.
    lines = "".join(traceback.format_exception_only(exc_type, exc)).strip().splitlines()
    summary = lines[0] + (" ..." if len(lines) > 1 else "") if lines else exc_type.__name__
    sys.stderr.write(
        f"mpi_strategy: uncaught exception on rank {rank} of {size} ({summary}); "
        f"{_what_happens_now(exc)} so that no rank waits for it.\n"
        + "".join(traceback.format_exception(exc_type, exc, tb))
    )
    sys.stderr.flush()
    sys.stdout.flush()
    time.sleep(1.0)  # lets the launcher forward the traceback before the abort
    if ulfm_launch():
        _leave_under_ulfm(exc)
    MPI.COMM_WORLD.Abort(1)


def _what_happens_now(exc: BaseException) -> str:
    if not ulfm_launch():
        return "aborting the MPI job"
    if _every_living_rank_raises(exc):
        return "this rank ends with status 1, as every living rank does,"
    return (
        "this rank kills itself (SIGKILL: the others learn of it; "
        "the last rank alive ends with status 1)"
    )


def _every_living_rank_raises(exc: BaseException) -> bool:
    if any(test(exc) for test in PROCESS.shared_errors):
        return True
    return ranks_were_lost(exc) or isinstance(exc, TooFewRanksError)


def raised_by_every_living_rank(test: Callable[[BaseException], bool]) -> None:
    """Adds an error that every living rank raises at once (``test(exc)``), so
    that under ULFM it ends each rank with status 1 (see ``_leave_under_ulfm``)."""
    PROCESS.shared_errors.append(test)


def _leave_under_ulfm(exc: BaseException) -> None:
    """An error that every living rank raises (ranks were lost, also in a call
    of the program's own or before training) ends each of them with exit
    status 1, which the launcher reports. A rank's own error kills it with
    SIGKILL: the others learn of it in their next collective (ULFM reports
    a death by signal, not a non-zero exit status), and go on without it inside
    ``elastic.run`` or end with status 1 outside.

    Open MPI's launcher (PRRTE 3, its errmgr/dvm) does not count a death by
    signal in ``mpirun``'s exit status under ULFM (a recoverable job), only a
    non-zero exit, and offers no option to count it. So the last rank alive
    (of the communicator last armed), which has no one left to tell, ends with
    status 1: else a job whose every rank died of its own error (the same bug
    on each) would end with status 0. Every rank raising at once is the usual case, and
    then none knows the others dead yet: so the highest rank not known dead
    waits (up to ``_LOWER_RANKS_WAIT_S``) to learn that the lower ones died,
    and they die at once (none waits for a rank that may never die). Inside
    ``elastic.run`` the survivors of that rank's own error go on that much
    later; on a machine slower than that wait, a job whose every rank failed
    may still end with status 0, as before, never a hang."""
    if _every_living_rank_raises(exc) or _the_last_alive():
        os._exit(1)
    os.kill(os.getpid(), signal.SIGKILL)


def _the_last_alive() -> bool:
    """True once every other rank of the communicator last armed is known
    dead; the highest rank not known dead waits for the lower ones (see
    ``_leave_under_ulfm``). False in a replacement not joined yet (alone in
    its world: the survivors must learn of its death)."""
    comm, deadline = PROCESS.failure_comm, time.monotonic() + _LOWER_RANKS_WAIT_S
    try:
        if comm in (None, MPI.COMM_NULL) or (comm.Get_size() == 1 and is_replacement()):
            return False
        rank = comm.Get_rank()
        alive = set(range(comm.Get_size())) - {rank}
        while alive:
            alive -= known_dead(comm)
            if (alive and max(alive) > rank) or time.monotonic() > deadline:
                return not alive
            time.sleep(0.01)
    except (MPI.Exception, NotImplementedError):  # (freed, or no ULFM query: as before)
        return False
    return True
