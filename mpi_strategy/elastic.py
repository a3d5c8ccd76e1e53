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

With fewer than ``min_ranks`` survivors the job ends instead, with the newest
commit saved in ``directory`` (a TensorFlow checkpoint); a relaunch of the
same program, at any world size, resumes from it and removes it once the
function has returned.

With ``replace_lost=True`` the survivors also start new processes for the
lost ranks, which join at a later commit (``mpi_strategy/replacement.py``).

Without ULFM (MPICH, or Open MPI without ``--with-ft ulfm``) a lost rank ends
the job, as without elastic mode.
"""

import atexit
import functools
import json
import os
import sys
import time

import numpy as np
import tensorflow as tf
from mpi4py import MPI

from mpi_strategy import replacement, write_point
from mpi_strategy.errors import MPIStrategyError, RanksLostError, TooFewRanksError
from mpi_strategy.failure import is_process_failure, ulfm_launch
from mpi_strategy.logs import logger

_COMMITS_KEPT = 2  # a rank may have committed once more than a survivor that was cut short
_PREFIX = "state"  # the checkpoint's name in run()'s directory


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
        object.__setattr__(self, "_on_commit", None)  # run()'s replacements join here

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
        self._commits.append((self._number, (variables, _read(variables)),
                              dict(self._values)))
        del self._commits[:-_COMMITS_KEPT]
        if self._on_commit is not None:
            self._on_commit()

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

    def _newest(self):
        """(number, values, arrays) of the newest commit, to send to a replacement."""
        number, (_, tensors), values = self._commits[-1]
        return number, values, [t.numpy() for t in tensors]

    def _specs(self):
        """(shape, numpy dtype) of each variable, as ``_newest()`` lists them."""
        return [(tuple(v.shape), tf.as_dtype(v.dtype).as_numpy_dtype)
                for v in _variables_of(self._trackables)]

    def _load(self, newest):
        """Sets the variables and values to ``_newest()`` of another rank, and commits."""
        number, values, arrays = newest
        variables = _variables_of(self._trackables)
        for variable, value in zip(variables, arrays):
            variable.assign(value)
        self._values.clear()
        self._values.update(values)
        object.__setattr__(self, "_number", number - 1)
        self.commit()


def run(strategy, state, min_ranks=1, directory="elastic_state", replace_lost=False):
    """Decorator: calls the function with ``state`` until it returns, continuing
    on the survivors each time ranks are lost (see the module docstring).

    Every rank returns what the function returned. Before the first call, the
    state is committed, or, if ``directory`` holds a state saved by an earlier
    launch, loaded from there (a log line says so); that saved state is removed
    once the function returns. ``min_ranks``: with fewer survivors, they save
    the newest commit that all of them hold in ``directory`` and raise
    ``TooFewRanksError`` naming it (the job ends). ``replace_lost``: after a
    recovery, start new processes of the program for the lost ranks; they join
    at the first commit after they are ready, and the world returns to its size
    (see ``mpi_strategy/replacement.py``).
    """
    if isinstance(min_ranks, bool) or not isinstance(min_ranks, int) or min_ranks < 1:
        raise ValueError(f"mpi_strategy.elastic.run: min_ranks must be an int >= 1, "
                         f"got {min_ranks!r}.")
    directory = os.fspath(directory)

    def decorate(train):
        @functools.wraps(train)
        def elastic_train(*args, **kwargs):
            resumed = False  # a replacement loads the survivors' commit
            if replacement.is_replacement() and not state.commit_number:
                _join(strategy, state)
            else:
                resumed = not state.commit_number and _start(strategy, state, directory)
            regrowth = _Regrowth(strategy, state) if replace_lost else None
            try:
                result = _train_until_done(train, strategy, state, min_ranks, directory,
                                           regrowth, args, kwargs)
            finally:
                if regrowth:
                    regrowth.stop()
            if resumed:
                _remove_saved(directory)
            return result
        return elastic_train
    return decorate


def _train_until_done(train, strategy, state, min_ranks, directory, regrowth, args, kwargs):
    while True:
        try:
            return train(state, *args, **kwargs)
        except _WorldGrew:
            continue  # at the commit just made, on more ranks
        except Exception as error:  # noqa: BLE001 - only lost ranks are handled
            if not _ranks_were_lost(strategy, error):
                raise
            _recover(strategy, state, min_ranks, directory, error)
            if regrowth:
                regrowth.after_recovery()


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


def _recover(strategy, state, min_ranks, directory, error):
    """Shrinks to the survivors, agrees on a commit, continues the strategy there."""
    times = {"detected_at": time.time()}
    old = strategy.extended._cross_device_ops.ordered_comm.comm  # pylint: disable=protected-access
    before = old.Get_size()
    started = time.monotonic()
    survivors = _shrink(old)
    size = survivors.Get_size()
    number = np.array([state.commit_number], np.int64)
    survivors.Allreduce(MPI.IN_PLACE, number, op=MPI.MIN)  # raw buffers: nothing unpickled
    number = int(number[0])
    times["shrink_s"] = time.monotonic() - started
    strategy.extended._continue_on(survivors)  # pylint: disable=protected-access
    _forget_keras_functions(state._trackables)  # pylint: disable=protected-access
    times["rebuild_s"] = time.monotonic() - started - times["shrink_s"]
    state.restore(number)
    times["rollback_s"] = time.monotonic() - started - times["shrink_s"] - times["rebuild_s"]
    if size < min_ranks:
        _save(strategy, state, directory)
        raise TooFewRanksError(
            f"mpi_strategy.elastic: {size} rank(s) left of {before}, fewer than "
            f"min_ranks={min_ranks}: the job ends. Commit #{number} "
            f"({_describe(state._values)}) is saved in {os.path.abspath(directory)}; "  # pylint: disable=protected-access
            "launching the program again resumes from it, at any number of ranks."
        ) from error
    recoveries.append(dict(times, ranks_before=before, ranks_after=size, commit=number))
    logger.warning(
        "mpi_strategy.elastic: lost %d rank(s); continuing on %d from commit #%d "
        "(agree and shrink %.3f s, rebuild the strategy %.3f s, roll back %.3f s)",
        before - size, size, number, times["shrink_s"], times["rebuild_s"],
        times["rollback_s"])


_SPAWN_WAIT_AT_END_S = 60  # at the program's end, for a spawn to return (then: leave)


class _WorldGrew(Exception):
    """Raised by a commit at which replacements joined: the function is called again."""


class _Regrowth:
    """``replace_lost``: after a recovery, replacements are spawned for the lost
    ranks; at the first commit once they are ready, they join (see replacement.py)."""

    def __init__(self, strategy, state):
        replacement.check_can_replace()
        self._strategy, self._state = strategy, state
        self._size = strategy.extended.comm.Get_size()  # the world to return to
        self._spawning = None
        self._dismissed = []  # spawns whose replacements must still be told to leave
        object.__setattr__(state, "_on_commit", self._at_commit)

    def after_recovery(self):
        self._dismiss()
        missing = self._size - self._strategy.extended.comm.Get_size()
        if missing > 0:
            self._spawning = replacement.Spawning(self._strategy.extended.comm, missing)
            logger.warning("mpi_strategy.elastic: starting %d replacement(s); they join "
                           "at the first commit once they are ready", missing)

    def stop(self):
        """The program ends: replacements not joined yet leave."""
        self._dismiss(wait_s=_SPAWN_WAIT_AT_END_S)
        if self._dismissed:
            logger.error("mpi_strategy.elastic: a spawn of replacements did not return in "
                         "%d s; they end on their own within %d s.", _SPAWN_WAIT_AT_END_S,
                         replacement.START_LIMIT_S)
        replacement.flush_sends(_SPAWN_WAIT_AT_END_S)

    def _dismiss(self, wait_s=0.0):
        if self._spawning is not None:
            self._dismissed.append(self._spawning)
            self._spawning = None
        self._dismissed = [s for s in self._dismissed if not s.dismiss(wait_s)]

    def _at_commit(self):
        if self._dismissed:
            self._dismiss()  # their spawn may have returned since
        spawning = self._spawning
        if spawning is None:
            return
        ordered = self._strategy.extended._cross_device_ops.ordered_comm  # pylint: disable=protected-access
        try:
            decision = spawning.decide()
            if decision == replacement.WAIT:
                return
            started = time.monotonic()
            merged = None
            if decision == replacement.JOIN:
                merged = spawning.join(self._state._newest())  # pylint: disable=protected-access
        except MPI.Exception as error:
            if not is_process_failure(error):
                raise
            # Revoked: the survivors in another collective raise too; the
            # recovery then tells the replacements to leave.
            raise ordered._ranks_lost(error) from error  # pylint: disable=protected-access
        self._spawning = None
        if merged is None:
            return  # given up: training goes on with the survivors
        before = ordered.size
        self._strategy.extended._continue_on(merged)  # pylint: disable=protected-access
        _forget_keras_functions(self._state._trackables)  # pylint: disable=protected-access
        replacements.append({"started_at": spawning.started_at,
                             "spawned_at": spawning.spawned_at, "joined_at": time.time(),
                             "join_s": time.monotonic() - started, "ranks_before": before,
                             "ranks_after": merged.Get_size(),
                             "commit": self._state.commit_number})
        logger.warning("mpi_strategy.elastic: %d replacement(s) joined: continuing on %d "
                       "ranks from commit #%d (%.1f s after they were started)",
                       merged.Get_size() - before, merged.Get_size(),
                       self._state.commit_number, time.time() - spawning.started_at)
        raise _WorldGrew()


def _join(strategy, state):
    """In a replacement: builds the optimizers' slots, waits for the survivors'
    next commit, and continues the strategy with them from it."""
    _build_optimizers(strategy, state._trackables)  # pylint: disable=protected-access
    if ulfm_launch():
        _end_without_finalize_once(strategy)
    merged, newest = replacement.join_survivors(state._specs())  # pylint: disable=protected-access
    strategy.extended._continue_on(merged)  # pylint: disable=protected-access
    state._load(newest)  # pylint: disable=protected-access


def _start(strategy, state, directory):
    """Builds the optimizers' slots, then commits the state, or loads it from
    ``directory`` if an earlier launch saved it there; True if loaded."""
    _build_optimizers(strategy, state._trackables)  # pylint: disable=protected-access
    if ulfm_launch():
        _end_without_finalize_once(strategy)
    elif strategy.extended.comm.Get_size() > 1:
        logger.warning("mpi_strategy.elastic: this launch has no User-Level Failure Mitigation "
                       "(%s): a lost rank ends the job. For elastic training, launch with Open "
                       "MPI 5's `mpirun --with-ft ulfm`.", MPI.Get_library_version().split(",")[0])
    prefix = os.path.join(directory, _PREFIX)
    saved = tf.io.gfile.exists(prefix + ".index")
    if saved:
        values = tf.Variable("")
        _checkpoint(state, values).read(prefix).assert_consumed()
        record = json.loads(values.numpy().decode())
        state._values.update(record["values"])  # pylint: disable=protected-access
        object.__setattr__(state, "_number", record["commit"] - 1)
        logger.warning("mpi_strategy.elastic: resuming from the state saved in %s (commit "
                       "#%d of an earlier launch on %d rank(s): %s)", os.path.abspath(directory),
                       record["commit"], record["ranks"], _describe(record["values"]))
    state.commit()
    return saved


def _save(strategy, state, directory):
    """Writes the variables and values as they are now (every rank calls it:
    the checkpoint's write is a write point, one writer per filesystem)."""
    record = {"commit": state.commit_number, "values": state._values,  # pylint: disable=protected-access
              "ranks": strategy.extended.comm.Get_size()}
    tf.io.gfile.makedirs(directory)
    _checkpoint(state, tf.Variable(json.dumps(record))).write(os.path.join(directory, _PREFIX))


def _remove_saved(directory):
    """Removes a saved state once the launch that resumed from it has finished."""
    if write_point.applies(directory):
        with write_point.write_point(directory, "mpi_strategy.elastic: remove the saved state"):
            if write_point.role() != write_point.IN_MEMORY:
                tf.io.gfile.rmtree(directory)
    else:
        tf.io.gfile.rmtree(directory)


def _checkpoint(state, values):
    trackables = {f"trackable_{i}": t for i, t in enumerate(state._trackables)}  # pylint: disable=protected-access
    return tf.train.Checkpoint(values=values, **trackables)


def _describe(values):
    return ", ".join(f"{k}={v!r}" for k, v in values.items()) or "no values"


def _end_without_finalize_once(strategy):
    if not _ending["registered"]:
        _ending["registered"] = True
        atexit.register(_end_without_finalize, strategy)


_ending = {"registered": False}


def _end_without_finalize(strategy):
    """At the end of an elastic program under ULFM: meet the living ranks, run
    the other exit handlers, and exit with status 0 without MPI_Finalize. After a
    process failure MPI_Finalize can hang (Open MPI 5.0: in 7 of 75 runs after a
    recovery, and whenever a rank died after the last collective, before the
    others learnt of it), so no rank calls it."""
    write_point.agree_on_the_end()  # returns if a rank died
    _meet_the_living(strategy.extended._cross_device_ops.ordered_comm.comm)  # pylint: disable=protected-access
    atexit.unregister(_end_without_finalize)
    if replacement.is_replacement():
        return  # exits as usual: Open MPI fails the job if a spawned process skips MPI_Finalize
    atexit._run_exitfuncs()  # pylint: disable=protected-access  (those registered before)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _meet_the_living(comm):
    """ULFM's agreement: returns on every living rank, failed or not."""
    try:
        comm.Agree(1)
    except MPI.Exception:
        pass  # a rank died at the very end: nothing left to wait for


# Every recovery of this process: when it noticed the failure (time.time())
# and how long each part took; read by benchmarks and examples.
recoveries = []
# Every time replacements joined (replace_lost): when they were started, their
# spawn returned and they joined (time.time()), how long the join took.
replacements = []
is_replacement = replacement.is_replacement


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


def _read(variables):
    """Snapshots of the variables' values in host memory (not an accelerator's),
    read in one traced function (one eager read per distributed variable costs
    ~0.1 ms, and a commit of a small model is dominated by such costs). The
    tensors are immutable: a later update of a variable on the host copies its
    buffer first (copy on write), so no copy is made here for CPU variables."""
    key = tuple(id(v) for v in variables)
    if _reader["key"] != key:
        def read_all():
            with tf.device("/device:CPU:0"):
                return [tf.identity(v) for v in variables]
        # Called as a concrete function: skips tf.function's argument matching
        # (~0.07 ms of the ~0.25 ms call).
        read = tf.function(read_all, autograph=False)
        _reader.update(key=key, read=read.get_concrete_function())
    return _reader["read"]()


_reader = {"key": None, "read": None}  # the newest state's reader, traced once


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


__all__ = ["State", "run", "KerasCallback", "is_replacement", "RanksLostError",
           "TooFewRanksError"]
