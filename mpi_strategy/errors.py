"""Exceptions raised by mpi_strategy (the same exception on every rank).

Which exception arrives where, in eager mode and inside ``tf.function``: see
``MPIStrategyError``.
"""

import tensorflow as tf


class MPIStrategyError(RuntimeError):
    """A misuse or failure that mpi_strategy detected; the message says how to fix it.

    Misuse found before any MPI op runs (a non-mpi4py `comm`, `jit_compile=True`
    around a collective, ranks with different device counts, ...) raises this
    class itself, in eager mode and in `tf.function` alike.

    Errors found while an MPI op runs are raised in the op's Python function (a
    `tf.numpy_function`). Run eagerly, the caller gets that exception. Inside a
    `tf.function` (Keras `fit` / `evaluate` / `predict` included, unless
    `run_eagerly=True`), TensorFlow replaces it by a `tf.errors.OpError` chosen by
    the exception's Python type; its message holds the class name, the
    message and the traceback. The subclasses in `mpi_strategy.errors` are
    chosen so that the `tf.errors` class is the same in both modes where
    TensorFlow allows it:

    | error | eager | inside `tf.function` |
    | --- | --- | --- |
    | the ranks disagree on a collective | `CollectiveMismatchError`: an `MPIStrategyError` and a `tf.errors.InvalidArgumentError` | `tf.errors.InvalidArgumentError` |
    | a collective timed out (`timeout_seconds`) | `CollectiveTimeoutError`: an `MPIStrategyError` and a `tf.errors.DeadlineExceededError` | `tf.errors.UnknownError` |

    So `except tf.errors.OpError` catches both in both modes, and `except
    MPIStrategyError` only in eager mode. (TensorFlow turns a `ValueError` into
    `InvalidArgumentError`, which is why `CollectiveMismatchError` is also a
    `ValueError`, and any exception it does not know, `tf.errors` classes
    included, into `UnknownError`.)
    """


class CollectiveMismatchError(MPIStrategyError, tf.errors.InvalidArgumentError, ValueError):
    """The ranks disagree on a collective (kind, dtype or shapes), or its input does not fit it.

    Eager: this class (an ``MPIStrategyError`` and a
    ``tf.errors.InvalidArgumentError``). Inside ``tf.function``:
    ``tf.errors.InvalidArgumentError`` (TensorFlow's class for a ``ValueError``
    raised in an op's Python function).
    """

    def __init__(self, message):
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)
        self.args = (message,)


class CollectiveTimeoutError(MPIStrategyError, tf.errors.DeadlineExceededError):
    """Some ranks did not reach a collective within ``timeout_seconds``.

    Eager: this class (an ``MPIStrategyError`` and a
    ``tf.errors.DeadlineExceededError``). Inside ``tf.function``:
    ``tf.errors.UnknownError`` (TensorFlow keeps no other class for an
    exception raised in an op's Python function).
    """

    def __init__(self, message):
        tf.errors.DeadlineExceededError.__init__(self, None, None, message)
        self.args = (message,)


class RanksLostError(MPIStrategyError):
    """A rank of the communicator died (a process failure reported by an MPI with
    User-Level Failure Mitigation, e.g. Open MPI's ``mpirun --with-ft ulfm``).

    Raised by the collective that noticed it, on every surviving rank (the
    communicator is revoked so that ranks waiting in another collective learn
    of it too). ``mpi_strategy.elastic.run`` catches it and continues on the
    survivors; elsewhere it ends the job, as any uncaught error does.
    """


class TooFewRanksError(MPIStrategyError):
    """Fewer ranks survived than ``mpi_strategy.elastic.run``'s ``min_ranks``.

    Raised on every surviving rank, once they saved the newest commit they all
    hold (the message names the directory); the job ends.
    """
