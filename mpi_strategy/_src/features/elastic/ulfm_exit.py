"""The end of an elastic program under ULFM: no MPI_Finalize.

After a process failure MPI_Finalize can hang (Open MPI 5.0: in 7 of 75 runs
after a recovery, and whenever a rank died after the last collective, before
the others learnt of it), so no rank calls it: the living ranks meet by ULFM's
agreement, the other exit handlers run, and the process exits with status 0.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mpi4py import MPI

from mpi_strategy._src.core import ulfm
from mpi_strategy._src.core.process import PROCESS


@dataclass
class UlfmExitState:
    """How to reach the living ranks at exit, once an elastic run set it (``PROCESS.of``)."""

    living: Callable[[], MPI.Intracomm] | None = None


def _state() -> UlfmExitState:
    return PROCESS.of(UlfmExitState)


def end_without_finalize(living: Callable[[], MPI.Intracomm]) -> None:
    """Asks for this end (an elastic run under ULFM); ``living()``: the
    communicator of the living ranks at the end (it changes at each recovery)."""
    _state().living = living


def end_if_elastic(this_handler: Callable[..., Any]) -> None:
    """At exit, after the ranks' last meeting (``features/at_exit.py``): if an
    elastic run asked for it, meets the living ranks and exits with status 0
    once the exit handlers registered before ``this_handler`` (the caller,
    unregistered first) have run. A replacement of a lost rank exits as usual:
    Open MPI fails the job if a spawned process skips MPI_Finalize."""
    living = _state().living
    if living is None:
        return
    ulfm.meet_the_living(living())
    if ulfm.is_replacement():
        return
    atexit.unregister(this_handler)
    atexit._run_exitfuncs()  # (a private function of atexit: the handlers left to run)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
