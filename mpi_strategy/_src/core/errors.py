"""The framework-free exceptions (public as ``mpi_strategy.errors``).

The two that are also ``tf.errors`` classes (a mismatch, a timeout) live in the
binding (``distribute/tf_errors.py``); the core raises whatever error classes its
``Agreement`` is given.
"""

from mpi_strategy._src.core.process import PROCESS

_PUBLIC_MODULE = "mpi_strategy.errors"


class MPIStrategyError(RuntimeError):
    """A misuse or failure that mpi_strategy detected; the message says how to fix it.

    Misuse found before any MPI op runs (a `jit_compile=True` around a
    collective, ranks with different device counts, ...) raises this
    class itself, in eager mode and in `tf.function` alike.

    Errors found while an MPI op runs are raised in Python (in the op's
    `tf.numpy_function`, or called back from a native kernel). Run eagerly, the
    caller gets that exception. Inside a `tf.function` (Keras `fit` /
    `evaluate` / `predict` included, unless `run_eagerly=True`), TensorFlow
    replaces it by a `tf.errors.OpError`: a native kernel sets the exception's
    own `tf.errors` class, a `tf.numpy_function` one chosen by the exception's
    Python type; its message holds the class name and the message (and, from
    a `tf.numpy_function`, the traceback). The subclasses in `mpi_strategy.errors` are
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

    A `comm` that is not an mpi4py intracommunicator raises `TypeError`, and
    `MPI.COMM_NULL` raises `ValueError`, as Python does for a wrong argument.
    """  # noqa: E501 - the table's rows (Markdown, rendered in the docs) cannot wrap


class RanksLostError(MPIStrategyError):
    """A rank of the communicator died (a process failure reported by an MPI with
    User-Level Failure Mitigation, e.g. Open MPI's ``mpirun --with-ft ulfm``).

    Raised by the collective that noticed it, on every surviving rank (the
    communicator is revoked so that ranks waiting in another collective learn
    of it too). ``mpi_strategy.elastic.run`` catches it and continues on the
    survivors; elsewhere it ends the job, as any uncaught error does.
    """

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        PROCESS.ranks_lost += 1  # (see core/failure.py's ranks_were_lost)


class TooFewRanksError(MPIStrategyError):
    """Fewer ranks survived than ``mpi_strategy.elastic.run``'s ``min_ranks``.

    Raised on every surviving rank, once they saved the newest commit they all
    hold (the message names the directory); the job ends.
    """


for _class in (MPIStrategyError, RanksLostError, TooFewRanksError):
    _class.__module__ = _PUBLIC_MODULE  # what tracebacks and messages name
