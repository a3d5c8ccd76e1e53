"""The exceptions that are also ``tf.errors`` classes (public as ``mpi_strategy.errors``)."""

import tensorflow as tf

from mpi_strategy._src.core.errors import MPIStrategyError


class CollectiveMismatchError(MPIStrategyError, tf.errors.InvalidArgumentError, ValueError):
    """The ranks disagree on a collective (kind, dtype or shapes), or its input does not fit it.

    Eager: this class (an ``MPIStrategyError`` and a
    ``tf.errors.InvalidArgumentError``). Inside ``tf.function``:
    ``tf.errors.InvalidArgumentError`` (TensorFlow's class for a ``ValueError``
    raised in an op's Python function).
    """

    def __init__(self, message: str) -> None:
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)
        self.args = (message,)


class CollectiveTimeoutError(MPIStrategyError, tf.errors.DeadlineExceededError):
    """Some ranks did not reach a collective within ``timeout_seconds``.

    Eager: this class (an ``MPIStrategyError`` and a
    ``tf.errors.DeadlineExceededError``). Inside ``tf.function``:
    ``tf.errors.UnknownError`` (TensorFlow keeps no other class for an
    exception raised in an op's Python function).
    """

    def __init__(self, message: str) -> None:
        tf.errors.DeadlineExceededError.__init__(self, None, None, message)
        self.args = (message,)


for _class in (CollectiveMismatchError, CollectiveTimeoutError):
    _class.__module__ = "mpi_strategy.errors"
