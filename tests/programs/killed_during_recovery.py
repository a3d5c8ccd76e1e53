"""Run by tests/launchers/features/elastic/test_elastic.py under ULFM: another program, with one
rank of the launch SIGKILLed in the middle of the first recovery.

    python tests/programs/killed_during_recovery.py RANK PROGRAM [ARGS...]

Runs PROGRAM (an elastic program that loses a rank by itself: its ``--kill``)
as ``__main__`` with ARGS. Rank RANK of the launch kills itself as soon as the
survivors of that first loss have shrunk their communicator together
(``core/ulfm.py``'s ``shrink`` returned): the others are then rebuilding on
it, with it, and must shrink again. The point is set from here, not by the
library, so that every run loses the rank at the same moment.
"""

import os
import runpy
import signal
import sys

from mpi4py import MPI

from mpi_strategy._src.core import ulfm

victim, path, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
if MPI.COMM_WORLD.Get_rank() == victim:
    shrink = ulfm.shrink

    def shrink_then_die(comm):
        shrink(comm)
        os.kill(os.getpid(), signal.SIGKILL)

    ulfm.shrink = shrink_then_die
sys.argv = [path, *args]
runpy.run_path(path, run_name="__main__")
