"""MPI as the communication layer of tf.distribute.

    strategy = mpi_strategy.MPIStrategy()
    with strategy.scope():
        ...

Launch with ``mpiexec -n N python train.py``. Data path: user step ->
``strategy`` (replica semantics) -> ``cross_device_ops`` (what is reduced) ->
``fusion`` (what travels together) -> ``mpi_ops`` (ordered, graph-safe MPI
calls) -> ``rendezvous`` (the ranks agree on each collective) -> mpi4py.
"""

from mpi_strategy import logs

logs.configure()

from mpi_strategy.cluster_resolver import MPIClusterResolver  # noqa: E402
from mpi_strategy.cross_device_ops import MPICrossDeviceOps  # noqa: E402
from mpi_strategy.errors import (  # noqa: E402
    CollectiveMismatchError, CollectiveTimeoutError, MPIStrategyError, RanksLostError,
    TooFewRanksError)
from mpi_strategy.saving import only_chief_writes  # noqa: E402,F401  (deprecated)
from mpi_strategy.strategy import MPIStrategy  # noqa: E402
from mpi_strategy import elastic  # noqa: E402,F401

__version__ = "0.1.0"

__all__ = ["MPIStrategy", "MPICrossDeviceOps", "MPIClusterResolver", "MPIStrategyError",
           "CollectiveMismatchError", "CollectiveTimeoutError", "RanksLostError", "TooFewRanksError",
           "elastic"]
