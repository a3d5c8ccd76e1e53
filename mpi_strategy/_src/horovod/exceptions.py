"""The exceptions of Horovod's API, as Horovod's callers catch them.

A disagreement between ranks is a ``tf.errors.FailedPreconditionError`` in
Horovod (eager); here too, and also an ``MPIStrategyError`` whose message
names what every rank was doing. Inside ``tf.function`` TensorFlow keeps no
class for an exception raised in an op's Python function: it arrives as
``tf.errors.UnknownError`` with the same message.
"""

import tensorflow as tf

from mpi_strategy._src.core.errors import MPIStrategyError, RanksLostError


class MismatchError(MPIStrategyError, tf.errors.FailedPreconditionError):
    """The ranks disagree on a collective (op, dtype, shape, root rank, order)."""

    def __init__(self, message: str) -> None:
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)
        self.args = (message,)


class StalledError(MPIStrategyError, tf.errors.DeadlineExceededError):
    """Some ranks did not reach a collective within the timeout."""

    def __init__(self, message: str) -> None:
        tf.errors.DeadlineExceededError.__init__(self, None, None, message)
        self.args = (message,)


class HorovodInternalError(RuntimeError):
    """Horovod's error for a failed collective (a lost rank, under elastic training)."""


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's interrupt when the set of hosts changed (elastic training)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


for _class in (MismatchError, StalledError):
    _class.__module__ = "mpi_strategy.horovod.errors"

__all__ = [
    "MismatchError",
    "StalledError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "RanksLostError",
]
