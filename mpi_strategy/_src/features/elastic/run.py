"""Elastic training's run loop (the usage example: ``mpi_strategy.elastic``).

When a rank dies (SIGKILL, a node lost), the MPI library (User-Level Failure
Mitigation) makes the collective that notices it fail; mpi_strategy revokes
the communicator, so that every survivor's collective fails too
(``RanksLostError``). ``run`` then, on every survivor: shrinks the
communicator to the living ranks, agrees with them on the newest commit that
all of them hold, makes the strategy span the survivors (same variables; new
rank, world size and replica ids), restores the model, optimizer and values
from that commit, and calls the function again. With the same global batch
per step, the run continues as a run started on the survivors from that commit.

With fewer than ``min_ranks`` survivors the job ends instead, with the newest
commit saved in ``directory`` (a TensorFlow checkpoint); a relaunch of the
same program, at any world size, resumes from it and removes it once the
function has returned.

With ``replace_lost=True`` the survivors also start new processes for the
lost ranks, which join at a later commit (``regrowth.py``: the survivors'
side, ``replacement.py``: the replacements').

Without ULFM (MPICH, or Open MPI without ``--with-ft ulfm``) a lost rank ends
the job, as without elastic mode.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

import tensorflow as tf
from mpi4py import MPI

from mpi_strategy._src.core import failure, ulfm
from mpi_strategy._src.core.logs import logger
from mpi_strategy._src.distribute.strategy import MPIStrategy
from mpi_strategy._src.features import sharding as sharded_optimizers
from mpi_strategy._src.features.elastic import (
    disk,
    recovery,
    regrowth as regrowth_lib,
    replacement,
    state as state_lib,
    ulfm_exit,
)
from mpi_strategy._src.features.elastic.state import State

Result = TypeVar("Result")


def run(
    strategy: MPIStrategy,
    state: State,
    min_ranks: int = 1,
    directory: str | os.PathLike[str] = "elastic_state",
    replace_lost: bool = False,
) -> Callable[[Callable[..., Result]], Callable[..., Result]]:
    """Decorator: calls the function with ``state`` until it returns, continuing
    on the survivors each time ranks are lost (see the module docstring).

    Every rank returns what the function returned. Before the first call, the
    state is committed, or, if ``directory`` holds a state saved by an earlier
    launch, loaded from there (a log line says so); that saved state is removed
    once the function returns. ``min_ranks``: with fewer survivors, they save
    the newest commit that all of them hold in ``directory`` and raise
    ``TooFewRanksError`` naming it (the job ends). ``replace_lost``: after a
    recovery, start new processes of the program for the lost ranks; they join
    at the first commit after they are ready, and the world returns to its size.
    """
    if isinstance(min_ranks, bool) or not isinstance(min_ranks, int) or min_ranks < 1:
        raise ValueError(
            f"mpi_strategy.elastic.run: min_ranks must be an int >= 1, got {min_ranks!r}."
        )
    where = os.fspath(directory)

    def decorate(train: Callable[..., Result]) -> Callable[..., Result]:
        @functools.wraps(train)
        def elastic_train(*args: Any, **kwargs: Any) -> Result:
            resumed = False  # a replacement loads the survivors' commit
            if ulfm.is_replacement() and not state.commit_number:
                _join(strategy, state)
            else:
                resumed = not state.commit_number and _start(strategy, state, where)
            regrowth = regrowth_lib.Regrowth(strategy, state) if replace_lost else None
            try:
                with ulfm_exit.exits_seen():
                    result = _train_until_done(
                        train, strategy, state, min_ranks, where, regrowth, args, kwargs
                    )
            finally:
                if regrowth:
                    regrowth.stop()
            if resumed:
                disk.remove_saved(strategy, where)
            return result

        return elastic_train

    return decorate


def _train_until_done(
    train: Callable[..., Result],
    strategy: MPIStrategy,
    state: State,
    min_ranks: int,
    directory: str,
    regrowth: regrowth_lib.Regrowth | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Result:
    while True:
        since = failure.lost_mark()
        try:
            return train(state, *args, **kwargs)
        except regrowth_lib.WorldGrew:
            continue  # at the commit just made, on more ranks
        except Exception as error:  # only lost ranks are handled: others re-raised
            if not recovery.ranks_were_lost(strategy, error, since):
                raise
            recovery.recover(strategy, state, min_ranks, directory, error)
            if regrowth:
                regrowth.after_recovery()


class KerasCallback(tf.keras.callbacks.Callback):
    """For ``model.fit`` inside ``elastic.run``: commits ``state`` at the end of
    every epoch, with ``state.epoch`` set to the number of epochs done. After a
    recovery, call ``fit`` again with ``initial_epoch=state.epoch``: it goes on
    from the last epoch that every survivor finished.
    """

    def __init__(self, state: State) -> None:
        super().__init__()
        self._state = state

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._state.epoch = epoch + 1
        self._state.commit()


def _join(strategy: MPIStrategy, state: State) -> None:
    """In a replacement: builds the optimizers' slots, waits for the survivors'
    next commit, and continues the strategy with them from it."""
    _build_optimizers(strategy, state_lib.trackables_of(state))
    if ulfm.ulfm_launch():
        ulfm_exit.end_without_finalize(lambda: strategy.extended.ordered_comm.comm)
    merged, newest = replacement.join_survivors(state_lib.specs(state))
    recovery.grown(strategy, state, merged, newest)


def _start(strategy: MPIStrategy, state: State, directory: str) -> bool:
    """Builds the optimizers' slots, then commits the state, or loads it from
    ``directory`` if an earlier launch saved it there; True if loaded."""
    _build_optimizers(strategy, state_lib.trackables_of(state))
    if ulfm.ulfm_launch():
        ulfm_exit.end_without_finalize(lambda: strategy.extended.ordered_comm.comm)
    elif strategy.extended.comm.Get_size() > 1:
        logger.warning(
            "mpi_strategy.elastic: this launch has no User-Level Failure Mitigation "
            "(%s): a lost rank ends the job. For elastic training, launch with Open "
            "MPI 5's `mpirun --with-ft ulfm`.",
            MPI.Get_library_version().split(",")[0],
        )
    if disk.resume_if_saved(state, directory):
        return True
    state.commit()
    return False


def _build_optimizers(strategy: MPIStrategy, trackables: tuple[Any, ...]) -> None:
    """Creates the slots (momentum, ...) of Keras optimizers that have not made
    a step yet (Keras 3's and tf_keras's), so that the first commit holds
    them: a rollback to it must reset them too (and a sharded optimizer's be
    cut for the survivors)."""
    models = [
        t for t in trackables if hasattr(t, "trainable_variables") and not hasattr(t, "iterations")
    ]
    for optimizer in trackables:
        if hasattr(optimizer, "iterations") and not sharded_optimizers.built(optimizer):
            with strategy.scope():
                optimizer.build([v for m in models for v in m.trainable_variables])
