"""Recovery from lost ranks: shrink to the survivors, agree on a commit,
continue the strategy there, roll back. ``shrink_and_continue`` is the part
that both elastic faces share (``elastic.run`` and Horovod's ``hvd.elastic``)."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import tensorflow as tf
from mpi4py import MPI

from mpi_strategy._src.core import failure, ulfm
from mpi_strategy._src.core.errors import MPIStrategyError, TooFewRanksError
from mpi_strategy._src.core.logs import logger
from mpi_strategy._src.core.process import PROCESS
from mpi_strategy._src.distribute.ordered_comm import OrderedComm
from mpi_strategy._src.distribute.strategy import MPIStrategy
from mpi_strategy._src.features.elastic import disk, sharded, state as state_lib, ulfm_exit
from mpi_strategy._src.features.elastic.state import State


@dataclass
class ElasticRecord:
    """What elastic training did in this process (``PROCESS.of``; public as
    ``mpi_strategy.elastic.recoveries`` and ``.replacements``, the same lists),
    read by benchmarks and examples."""

    # Every recovery: when it noticed the failure (time.time()) and how long
    # each part took.
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    # Every time replacements joined (regrowth.py): when they were started,
    # their spawn returned and they joined (time.time()), how long the join took.
    replacements: list[dict[str, Any]] = field(default_factory=list)


def record() -> ElasticRecord:
    """This process's ``ElasticRecord``."""
    return PROCESS.of(ElasticRecord)


Continued = TypeVar("Continued")


def ranks_were_lost(strategy: MPIStrategy, error: BaseException, since: int) -> bool:
    """True if ``error``, raised by code started at ``failure.lost_mark()`` =
    ``since``, comes from a lost rank (``failure.ranks_were_lost``, the rule
    Horovod's face follows too)."""
    return failure.ranks_were_lost(error, [strategy.extended.ordered_comm], since)


class StaleCollectiveError(MPIStrategyError):
    """A collective of a ``tf.function`` traced before a recovery, on the
    communicator of before it (every survivor that calls it raises this)."""


StaleCollectiveError.__module__ = "mpi_strategy.elastic"  # its public name


def is_stale(error: BaseException) -> bool:
    """A ``StaleCollectiveError``, also as it leaves a tf.function (its name in
    the message): every survivor raises it at once."""
    return isinstance(error, StaleCollectiveError) or (
        isinstance(error, tf.errors.OpError) and StaleCollectiveError.__name__ in str(error)
    )


failure.raised_by_every_living_rank(is_stale)


def _stale(size: int) -> StaleCollectiveError:
    return StaleCollectiveError(
        f"mpi_strategy.elastic: a collective ran on the {size}-rank communicator of "
        "before the last recovery, from a tf.function traced before it. A traced function "
        "keeps the collectives and the world size of its trace: build the tf.functions "
        "(and Keras models' train functions) inside the function that elastic.run "
        "decorates, so that each call after a recovery traces them anew."
    )


def recover(
    strategy: MPIStrategy, state: State, min_ranks: int, directory: str, error: BaseException
) -> None:
    """Shrinks to the survivors, agrees on a commit, continues the strategy there
    (collective over the survivors). With fewer than ``min_ranks`` survivors,
    saves that commit in ``directory`` and raises ``TooFewRanksError``."""
    times = {"detected_at": time.time()}
    ordered = strategy.extended.ordered_comm
    before = ordered.size
    started = time.monotonic()

    def agree_and_continue(survivors: MPI.Intracomm) -> int:
        number = np.array([state.commit_number], np.int64)
        survivors.Allreduce(MPI.IN_PLACE, number, op=MPI.MIN)  # raw buffers: nothing unpickled
        times["shrink_s"] = time.monotonic() - started
        continue_on(strategy, state, survivors)
        # Collective (and so repeated if a rank dies meanwhile): a sharded
        # optimizer's slots, put together from the survivors.
        _restore_sharded(strategy, state, int(number[0]))
        return int(number[0])

    survivors, commit = retire_and_shrink(
        ordered, functools.partial(_stale, before), agree_and_continue
    )
    size = survivors.Get_size()
    times["rebuild_s"] = time.monotonic() - started - times["shrink_s"]
    if state_lib.commit_of(state, commit)[3] is None:  # (else restored already)
        state.restore(commit)
    times["rollback_s"] = time.monotonic() - started - times["shrink_s"] - times["rebuild_s"]
    if size < min_ranks:
        disk.save(strategy, state, directory)
        raise TooFewRanksError(
            f"mpi_strategy.elastic: {size} rank(s) left of {before}, fewer than "
            f"min_ranks={min_ranks}: the job ends. Commit #{commit} "
            f"({disk.describe(state_lib.values_of(state))}) is saved in "
            f"{os.path.abspath(directory)}; launching the program again resumes from it, "
            "at any number of ranks."
        ) from error
    record().recoveries.append(dict(times, ranks_before=before, ranks_after=size, commit=commit))
    logger.warning(
        "mpi_strategy.elastic: lost %d rank(s); continuing on %d from commit #%d "
        "(agree and shrink %.3f s, rebuild the strategy %.3f s, roll back %.3f s)",
        before - size,
        size,
        commit,
        times["shrink_s"],
        times["rebuild_s"],
        times["rollback_s"],
    )


def _restore_sharded(strategy: MPIStrategy, state: State, number: int) -> None:
    """If commit ``number`` holds a sharded optimizer's slots, restores it on the
    survivors (``sharded.restore``; the rebuild's time includes it)."""
    _, committed, _, copies = state_lib.commit_of(state, number)
    if copies is None:
        return
    _restore(strategy, state, committed, copies)
    state_lib.roll_back_values(state, number)


def _restore(
    strategy: MPIStrategy,
    state: State,
    committed: tuple[list[Any], list[Any]],
    copies: sharded.Copies,
) -> None:
    trackables = state_lib.trackables_of(state)
    sharded.restore(
        strategy, trackables, lambda: state_lib.variables_of(trackables), committed, copies
    )


def grown(
    strategy: MPIStrategy,
    state: State,
    merged: MPI.Intracomm,
    received: state_lib.Newest | None = None,
) -> None:
    """After replacements joined (collective over ``merged``: the survivors
    pass no ``received``, a replacement the commit they sent it, which becomes
    its own): the strategy spans ``merged``, at the survivors' newest commit.

    With a sharded optimizer, its slots are cut anew for ``merged``, each put
    together from the survivors that hold its pieces (the replacements hold
    none), and every rank commits: the copies on the next rank are those of
    the new partition, so that a rank lost before the next commit loses
    nothing. A rank lost before that commit is made on every rank: every rank
    still holds the joined commit (with its copies among the survivors), which
    the recovery goes back to."""
    continue_on(strategy, state, merged)
    if received is not None:
        state_lib.hold(state, received)
    _, committed, _, copies = state_lib.commit_of(state, None)
    if copies is not None:
        _restore(strategy, state, committed, copies)
        state.commit()
    elif received is not None:
        state.restore()


def retire_and_shrink(
    ordered: OrderedComm,
    stale: Callable[[], Exception],
    continue_there: Callable[[MPI.Intracomm], Continued],
) -> tuple[MPI.Intracomm, Continued]:
    """``shrink_and_continue`` from ``ordered``'s communicator, once every later
    collective of ``ordered`` (a tf.function traced before the recovery keeps
    it) raises ``stale()`` instead of calling MPI there (on a revoked
    communicator it would raise ``RanksLostError``: another recovery, with no
    rank lost). Both elastic faces recover through it."""
    ordered.collectives.retire(stale)
    return shrink_and_continue(ordered.comm, continue_there)


def shrink_and_continue(
    comm: MPI.Intracomm, continue_there: Callable[[MPI.Intracomm], Continued]
) -> tuple[MPI.Intracomm, Continued]:
    """The living ranks of ``comm`` and what ``continue_there`` returned on
    them, on every survivor (collective over them). ``continue_there(survivors)``
    rebuilds what spans them with its own collectives; when another rank dies
    meanwhile, every survivor shrinks again and calls it again on fewer ranks
    (an agreement tells them all whether it went through on every one)."""
    ulfm_exit.ranks_were_lost()
    while True:
        survivors = ulfm.shrink(comm)
        continued: list[Continued] = []
        since = failure.lost_mark()
        try:
            continued.append(continue_there(survivors))
        except Exception as error:
            if not failure.ranks_were_lost(error, since=since):
                raise
            ulfm.revoke(survivors)  # the survivors still in its collectives leave them
        if ulfm.all_agree(survivors, bool(continued)):
            return survivors, continued[0]
        comm = survivors


def continue_on(strategy: MPIStrategy, state: State, comm: MPI.Intracomm) -> None:
    """The strategy spans ``comm`` from now on; Keras traces its functions again."""
    strategy.extended.continue_on(comm)
    _forget_keras_functions(state_lib.trackables_of(state))


def _forget_keras_functions(trackables: tuple[Any, ...]) -> None:
    """Keras keeps a model's traced train / test / predict functions; traced
    for the old world size, they must be traced again."""
    for model in trackables:
        for name in ("train_function", "test_function", "predict_function"):
            if getattr(model, name, None) is not None:
                setattr(model, name, None)
