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
from typing import Any

from mpi_strategy._src.core import ulfm
from mpi_strategy._src.distribute.strategy import MPIStrategy

_state: dict[str, MPIStrategy | None] = {"strategy": None}


def end_without_finalize(strategy: MPIStrategy) -> None:
    """Asks for this end (``elastic.run`` under ULFM), over ``strategy``'s ranks."""
    _state["strategy"] = strategy


def end_if_elastic(this_handler: Callable[..., Any]) -> None:
    """At exit, after the ranks' last meeting (``features/ending.py``): if an
    elastic run asked for it, meets the living ranks and exits with status 0
    once the exit handlers registered before ``this_handler`` (the caller,
    unregistered first) have run. A replacement of a lost rank exits as usual:
    Open MPI fails the job if a spawned process skips MPI_Finalize."""
    strategy = _state["strategy"]
    if strategy is None:
        return
    ulfm.meet_the_living(strategy.extended.ordered_comm.comm)
    if ulfm.is_replacement():
        return
    atexit.unregister(this_handler)
    atexit._run_exitfuncs()  # (a private function of atexit: the handlers left to run)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
