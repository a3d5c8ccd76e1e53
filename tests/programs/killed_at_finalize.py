"""The end of an elastic program under ULFM, with ranks killed as the others finalize.

    mpirun --with-ft ulfm -n 8 python tests/programs/killed_at_finalize.py

Every rank ends as an elastic run that lost no rank ends (the library's exit
handler: ULFM's agreement, then MPI_Finalize); right after that agreement,
the odd ranks kill themselves with SIGKILL within 2 ms, at random, while the
others finalize: the launch must end. With Open MPI's barrier in MPI_Finalize
kept, 7 of 15 launches at 8 ranks left the survivors waiting there for good.
Only mpi4py is imported (the package's __init__ would load TensorFlow).
"""

import atexit
import os
import random
import signal
import sys
import time
import types

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
package = types.ModuleType("mpi_strategy")  # the core, without mpi_strategy/__init__.py
package.__path__ = [os.path.join(REPO, "mpi_strategy")]
sys.modules["mpi_strategy"] = package

from mpi4py import MPI

from mpi_strategy._src.features.elastic import ulfm_exit

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()


def killed_after_the_agreement() -> None:
    time.sleep(random.uniform(0, 0.002))
    os.kill(os.getpid(), signal.SIGKILL)


def library_exit() -> None:  # as effects._at_exit calls it
    ulfm_exit.end_if_elastic(library_exit)


if RANK % 2 == 1:
    atexit.register(killed_after_the_agreement)  # (runs after the library's handler)
ulfm_exit.end_without_finalize(lambda: WORLD)
atexit.register(library_exit)
WORLD.Barrier()
print(f"rank {RANK}: at the end", flush=True)
