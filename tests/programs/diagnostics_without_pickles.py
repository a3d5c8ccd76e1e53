"""Run by tests/launchers/test_main.py on 2 ranks: ``python -m mpi_strategy`` made to fail.

mpi4py's pickle is replaced by one that raises, so any pickled message fails
the run; rank 1 reports a non-ASCII host name and one replica too many (a
wrong sum). Shows that the diagnostics send no pickles, survive the host name
and name rank 1 as the failing rank.
"""

import runpy
import socket
import sys

from mpi4py import MPI


def no_pickles(*args, **kwargs):
    raise AssertionError("mpi4py pickled a message")


MPI.pickle.__init__(no_pickles, no_pickles)
rank = MPI.COMM_WORLD.Get_rank()
if rank == 1:
    socket.gethostname = lambda: "h\u00f4st-\u2603"

import mpi_strategy


class OffByOneOnRank1(mpi_strategy.MPIStrategy):
    @property
    def num_replicas_in_sync(self):
        return super().num_replicas_in_sync + (rank == 1)


mpi_strategy.MPIStrategy = OffByOneOnRank1
sys.argv = ["mpi_strategy"]
runpy.run_module("mpi_strategy", run_name="__main__")
