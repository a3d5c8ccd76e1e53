"""Elastic training: lose ranks and keep training, in place, without a relaunch.

    mpirun --with-ft ulfm -n 4 python train.py      # Open MPI 5 with ULFM

    strategy = MPIStrategy()
    with strategy.scope():
        model, optimizer = ...
    state = mpi_strategy.elastic.State(model, optimizer, step=0)

    @mpi_strategy.elastic.run(strategy, state)
    def train(state):
        step_fn = tf.function(...)          # traced again after every recovery
        while state.step < STEPS:
            ... one step on the batch of step state.step ...
            state.step += 1
            if state.step % 10 == 0:
                state.commit()              # in memory, the same on every rank

    train()

When a rank dies (SIGKILL, a node lost), the MPI library (User-Level Failure
Mitigation) makes the collective that notices it fail; mpi_strategy revokes
the communicator, so that every survivor's collective fails too
(``RanksLostError``). ``run`` then, on every survivor: shrinks the
communicator to the living ranks, agrees with them on the newest commit that
all of them hold, makes the strategy span the survivors (same variables; new
rank, world size and replica ids), restores the model, optimizer and values
from that commit, and calls the function again. With the same global batch
per step, the run continues as a run started on the survivors from that commit.

Without ULFM (MPICH, or Open MPI without ``--with-ft ulfm``) a lost rank ends
the job, as without elastic mode.
"""

import atexit
import functools
import os
import sys
import time

import tensorflow as tf
from mpi4py import MPI

from mpi_strategy import write_point
from mpi_strategy.errors import MPIStrategyError, RanksLostError
from mpi_strategy.logs import logger

_COMMITS_KEPT = 2  # a rank may have committed once more than a survivor that was cut short


class State:
    """What survives a lost rank: variables (of models, optimizers, or
    ``tf.Variable``s) and named Python values (``state.step``, ``state.epoch``).

    ``commit()`` copies them, in memory, on every rank (no communication: they
    are the same on every rank). The values are attributes: ``state.step += 1``.
    """

    def __init__(self, *trackables, **values):
        object.__setattr__(self, "_trackables", trackables)
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "_commits", [])  # (number, variables, values), newest last
        object.__setattr__(self, "_number", 0)

    def __getattr__(self, name):
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        self._values[name] = value

    def commit(self):
        """Copies the variables and values; every rank must commit at the same steps."""
        object.__setattr__(self, "_number", self._number + 1)
        # Listed at every commit: optimizers create their slots at the first step.
        variables = _variables_of(self._trackables)
        self._commits.append((self._number, (variables, [v.numpy() for v in variables]),
                              dict(self._values)))
        del self._commits[:-_COMMITS_KEPT]

    @property
    def commit_number(self):
        """How many commits this rank made (the newest commit's number)."""
        return self._commits[-1][0] if self._commits else 0

    def restore(self, number=None):
        """Sets the variables and values back to commit ``number`` (default: the newest)."""
        matching = [c for c in self._commits if number is None or c[0] == number]
        if not matching:
            raise MPIStrategyError(
                f"mpi_strategy.elastic: commit #{number} is not held here (held: "
                f"{[c[0] for c in self._commits]}).")
        number, (variables, arrays), values = matching[-1]
        for variable, value in zip(variables, arrays):
            variable.assign(value)
        self._values.clear()
        self._values.update(values)
        object.__setattr__(self, "_number", number)
        del self._commits[[c[0] for c in self._commits].index(number) + 1:]


def run(strategy, state, min_ranks=1):
    """Decorator: calls the function with ``state`` until it returns, continuing
    on the survivors each time ranks are lost (see the module docstring).

    ``min_ranks``: with fewer survivors, the job ends with an error. Every rank
    returns what the function returned. The state is committed once before the
    first call.
    """
    def decorate(train):
        @functools.wraps(train)
        def elastic_train(*args, **kwargs):
            if not state.commit_number:
                _build_optimizers(strategy, state._trackables)  # pylint: disable=protected-access
                state.commit()
            while True:
                try:
                    return train(state, *args, **kwargs)
                except Exception as error:  # noqa: BLE001 - only lost ranks are handled
                    if not _ranks_were_lost(strategy, error):
                        raise
                    _recover(strategy, state, min_ranks, error)
        return elastic_train
    return decorate


class KerasCallback(tf.keras.callbacks.Callback):
    """For ``model.fit`` inside ``elastic.run``: commits ``state`` at the end of
    every epoch, with ``state.epoch`` set to the number of epochs done. After a
    recovery, call ``fit`` again with ``initial_epoch=state.epoch``: it goes on
    from the last epoch that every survivor finished.
    """

    def __init__(self, state):
        super().__init__()
        self._state = state

    def on_epoch_end(self, epoch, logs=None):
        self._state.epoch = epoch + 1
        self._state.commit()


def _ranks_were_lost(strategy, error):
    # Inside tf.function the RanksLostError arrives as a tf.errors class; the
    # communicator remembers it.
    return (isinstance(error, RanksLostError)
            or strategy.extended._cross_device_ops.ordered_comm.failed)  # pylint: disable=protected-access


def _recover(strategy, state, min_ranks, error):
    """Shrinks to the survivors, agrees on a commit, continues the strategy there."""
    times = {"detected_at": time.time()}
    old = strategy.extended._cross_device_ops.ordered_comm.comm  # pylint: disable=protected-access
    before = old.Get_size()
    started = time.monotonic()
    survivors = _shrink(old)
    size = survivors.Get_size()
    if size < min_ranks:
        raise MPIStrategyError(
            f"mpi_strategy.elastic: {size} rank(s) left of {before}, fewer than "
            f"min_ranks={min_ranks}.") from error
    number = survivors.allreduce(state.commit_number, op=MPI.MIN)
    times["shrink_s"] = time.monotonic() - started
    strategy.extended._continue_on(survivors)  # pylint: disable=protected-access
    _forget_keras_functions(state._trackables)  # pylint: disable=protected-access
    times["rebuild_s"] = time.monotonic() - started - times["shrink_s"]
    state.restore(number)
    times["rollback_s"] = time.monotonic() - started - times["shrink_s"] - times["rebuild_s"]
    recoveries.append(dict(times, ranks_before=before, ranks_after=size, commit=number))
    if len(recoveries) == 1:
        atexit.register(_end_without_finalize, strategy)
    logger.warning(
        "mpi_strategy.elastic: lost %d rank(s); continuing on %d from commit #%d "
        "(agree and shrink %.3f s, rebuild the strategy %.3f s, roll back %.3f s)",
        before - size, size, number, times["shrink_s"], times["rebuild_s"],
        times["rollback_s"])


def _end_without_finalize(strategy):
    """At the end of a program that lost ranks: meet the survivors, then exit
    with status 0 without MPI_Finalize, which can hang after a process failure
    (Open MPI 5.0: measured in 7 of 75 runs). Exit handlers registered before
    the first recovery do not run."""
    write_point.agree_on_the_end()
    try:
        strategy.extended.comm.Barrier()
    except MPI.Exception:
        pass  # another rank died at the very end: nothing left to wait for
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# Every recovery of this process: when it noticed the failure (time.time())
# and how long each part took; read by benchmarks and examples.
recoveries = []


def _shrink(comm):
    """The living ranks of ``comm`` (revoked), agreed on by all of them."""
    while True:
        try:
            comm.Revoke()
        except MPI.Exception:
            pass
        survivors = comm.Shrink()
        try:
            survivors.Agree(1)  # fails if another rank died meanwhile
            return survivors
        except MPI.Exception:
            comm = survivors


def _build_optimizers(strategy, trackables):
    """Creates the slots (momentum, ...) of Keras optimizers that have not made
    a step yet, so that the first commit holds them: a rollback to it must
    reset them too."""
    models = [t for t in trackables if hasattr(t, "trainable_variables")
              and not hasattr(t, "iterations")]
    for optimizer in trackables:
        if hasattr(optimizer, "iterations") and not getattr(optimizer, "built", True):
            with strategy.scope():
                optimizer.build([v for m in models for v in m.trainable_variables])


def _forget_keras_functions(trackables):
    """Keras keeps a model's traced train / test / predict functions; traced
    for the old world size, they must be traced again."""
    for model in trackables:
        for name in ("train_function", "test_function", "predict_function"):
            if getattr(model, name, None) is not None:
                setattr(model, name, None)


def _variables_of(trackables):
    variables = []
    for t in trackables:
        if isinstance(t, tf.Variable):
            variables.append(t)
        else:
            found = getattr(t, "variables", None)
            found = found() if callable(found) else found
            if found is None:
                raise TypeError(f"mpi_strategy.elastic.State: {t!r} has no variables.")
            variables.extend(found)
    return variables


__all__ = ["State", "run", "KerasCallback", "RanksLostError"]
