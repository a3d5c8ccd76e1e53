"""Exceptions raised by mpi_strategy (the same exception on every rank).

Which exception arrives where, in eager mode and inside ``tf.function``: see
``MPIStrategyError``.
"""

from mpi_strategy._src.core.errors import MPIStrategyError, RanksLostError, TooFewRanksError
from mpi_strategy._src.distribute.tf_errors import CollectiveMismatchError, CollectiveTimeoutError

__all__ = [
    "MPIStrategyError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "RanksLostError",
    "TooFewRanksError",
]
