"""Run by tests/launchers/core/test_validation_launched.py in one process.

MPI is initialised with MPI_THREAD_FUNNELED only, then MPIStrategy() is
built. The test shows that it fails, explaining which thread support it got
and which it needs.
"""

import mpi4py

mpi4py.rc.thread_level = "funneled"
import mpi_strategy

mpi_strategy.MPIStrategy()
