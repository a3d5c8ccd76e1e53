"""MPI as the communication layer of tf.distribute.

    strategy = mpi_strategy.MPIStrategy()
    with strategy.scope():
        ...

Launch with ``mpiexec -n N python train.py``. The public modules
(``mpi_strategy``, ``.errors``, ``.compression``, ``.elastic``, ``.timeline``)
are a thin face over ``mpi_strategy._src``, whose layers import only
downward (their order: ``.importlinter``; what each holds: docs/concepts.md,
"Layers").
"""

from mpi_strategy import compression, elastic, errors, timeline
from mpi_strategy._src import effects as _effects
from mpi_strategy._src.distribute.cluster_resolver import MPIClusterResolver
from mpi_strategy._src.distribute.cross_device_ops import MPICrossDeviceOps
from mpi_strategy._src.distribute.strategy import MPIStrategy
from mpi_strategy._src.features.saving.calls import (
    only_chief_writes as only_chief_writes,  # deprecated: importable, not in __all__
)
from mpi_strategy.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    MPIStrategyError,
    RanksLostError,
    TooFewRanksError,
)

for _public in (MPIStrategy, MPICrossDeviceOps, MPIClusterResolver):
    _public.__module__ = "mpi_strategy"  # what reprs, tracebacks and the docs name

_effects.install()

__version__ = "0.1.0"

__all__ = [
    "MPIStrategy",
    "MPICrossDeviceOps",
    "MPIClusterResolver",
    "MPIStrategyError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "RanksLostError",
    "TooFewRanksError",
    "compression",
    "elastic",
    "errors",
    "timeline",
]
