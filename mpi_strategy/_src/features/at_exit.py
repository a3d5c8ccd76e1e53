"""The end of the program: the ranks meet once more before MPI ends.

A rank saving alone (under ``if rank == 0``) finishes its save, and a rank
still waiting in a collective that the others left gets an error instead of a
hang. Run once, at exit (``effects.py``), on the newest MPIStrategy over all of
``COMM_WORLD`` (or all its living ranks after ranks were lost).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from mpi_strategy._src.core import failure, kinds
from mpi_strategy._src.core.errors import MPIStrategyError, RanksLostError
from mpi_strategy._src.core.process import PROCESS
from mpi_strategy._src.distribute.strategy import newest_over_the_world


@dataclass
class AtExitState:
    """The ranks' last meeting happened (``PROCESS.of``)."""

    ended: bool = False


def _state() -> AtExitState:
    return PROCESS.of(AtExitState)


def agree_on_the_end() -> None:
    """Meets the other ranks at the end of the program (once; see the module)."""
    strategy = newest_over_the_world()
    if _state().ended or strategy is None:
        return
    _state().ended = True
    ordered = strategy.extended.ordered_comm
    if (
        ordered.size == 1
        or not ordered.agreement.usable
        or ordered.failed
        or MPI.Is_finalized()
        or failure.aborting()
    ):
        return
    try:
        ordered.collectives.guarded(ordered.agreement.agree)(kinds.FINALIZE, np.uint8, [])
    except RanksLostError:
        return  # a rank died at the very end (ULFM): elastic training ends without it
    except MPIStrategyError as exc:
        sys.stderr.write(f"{exc}\n")
        sys.stderr.flush()
        time.sleep(1.0)  # lets the launcher forward the message before the abort kills all
        MPI.COMM_WORLD.Abort(1)
