"""MPI as the communication layer of tf.distribute.

    strategy = mpi_strategy.MPIStrategy()
    with strategy.scope():
        ...

Launch with ``mpiexec -n N python train.py``. Data path: user step ->
``strategy`` (replica semantics) -> ``cross_device_ops`` (what is reduced) ->
``fusion`` (how it is packed) -> ``mpi_ops`` (ordered, graph-safe MPI calls)
-> mpi4py.
"""

from mpi_strategy.cluster_resolver import MPIClusterResolver
from mpi_strategy.cross_device_ops import MPICrossDeviceOps
from mpi_strategy.errors import MPIStrategyError
from mpi_strategy.saving import only_chief_writes
from mpi_strategy.strategy import MPIStrategy

__version__ = "0.1.0"

__all__ = ["MPIStrategy", "MPICrossDeviceOps", "MPIClusterResolver", "MPIStrategyError",
           "only_chief_writes"]
