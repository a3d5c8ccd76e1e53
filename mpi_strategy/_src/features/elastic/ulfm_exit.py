"""The end of an elastic program under ULFM: no MPI_Finalize after a failure.

After a process failure MPI_Finalize can hang (Open MPI 5.0: in 7 of 75 runs
after a recovery, and whenever a rank died after the last collective, before
the others learnt of it). So the living ranks first meet by ULFM's agreement;
if no rank was ever lost, the program ends as any other (MPI_Finalize, its own
exit status), but without Open MPI's barrier in MPI_Finalize (a rank killed
during it left the others waiting there for good). Otherwise no rank calls
MPI_Finalize: the other exit handlers run, and the process exits with the
status of the ``SystemExit`` that ended the elastic run, if one did
(``sys.exit(42)`` on a preemption notice), else 0.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from mpi4py import MPI

from mpi_strategy._src.core import ulfm
from mpi_strategy._src.core.process import PROCESS


@dataclass
class UlfmExitState:
    """How to reach the living ranks at exit, once an elastic run set it (``PROCESS.of``)."""

    living: Callable[[], MPI.Intracomm] | None = None
    # A recovery happened (MPI_Finalize may hang).
    ranks_lost: bool = False
    # The exit status of the SystemExit that ended an elastic run (None: none did).
    status: int | None = None


def _state() -> UlfmExitState:
    return PROCESS.of(UlfmExitState)


def end_without_finalize(living: Callable[[], MPI.Intracomm]) -> None:
    """Asks for this end (an elastic run under ULFM); ``living()``: the
    communicator of the living ranks at the end (it changes at each recovery)."""
    _state().living = living


def ranks_were_lost() -> None:
    """A recovery from lost ranks began: the end skips MPI_Finalize."""
    _state().ranks_lost = True


@contextlib.contextmanager
def exits_seen() -> Iterator[None]:
    """Around an elastic run: a ``SystemExit`` that ends it gives the exit
    status of a process that skips MPI_Finalize."""
    try:
        yield
    except SystemExit as exiting:
        _state().status = _exit_status(exiting.code)
        raise


def _exit_status(code: object) -> int:
    """The status Python exits with for ``SystemExit(code)``."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1  # (Python prints a message for others)


def end_if_elastic(this_handler: Callable[..., Any]) -> None:
    """At exit, after the ranks' last meeting (``features/at_exit.py``): if an
    elastic run asked for it, meets the living ranks; then, if a rank was
    lost, exits (the status of the module's docstring) once the exit handlers
    registered before ``this_handler`` (the caller, unregistered first) have
    run. A replacement of a lost rank exits as usual: Open MPI fails the job
    if a spawned process skips MPI_Finalize."""
    state = _state()
    if state.living is None:
        return
    all_living = ulfm.meet_the_living(state.living())
    if ulfm.is_replacement() or (all_living and not state.ranks_lost):
        # Every rank is past its last call: Open MPI's barrier in MPI_Finalize
        # only adds a moment in which a rank killed leaves the others waiting.
        ulfm.finalize_without_barrier()
        return
    atexit.unregister(this_handler)
    atexit._run_exitfuncs()  # (a private function of atexit: the handlers left to run)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(state.status or 0)
