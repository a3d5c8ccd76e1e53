"""Horovod's elastic training (``hvd.elastic``) on the library's ULFM recovery.

``run(func)`` calls ``func(state, ...)`` until it returns. When a rank dies
(Open MPI 5's ``mpirun --with-ft ulfm``), the collective that notices it
revokes its communicator (``core/collectives.py``), so that every survivor's
collective raises ``RanksLostError``; ``run`` then, on every survivor, shrinks
the global process set's communicator to the living ranks and continues
Horovod's global process set on them (new ``rank()`` and ``size()``; the
library's recovery routine, ``features/elastic/recovery.py``, which shrinks
again if another rank dies meanwhile), restores the state's last commit,
runs its reset callbacks, broadcasts the state from the new rank 0
(``sync``) and calls ``func`` again.
Without ULFM (MPICH, or Open MPI without ``--with-ft ulfm``) a lost rank ends
the job, as without elastic mode.

Horovod's elastic driver (``horovodrun --host-discovery-script``: hosts that
come and go, workers added) does not exist here: there are no host
notifications (``check_host_updates`` checks nothing) and no rank joins.

A ``tf.function`` traced before a reset keeps the collectives it was traced
with (and the world size: ``hvd.Average`` divides by it): build the traced
functions inside ``func``, so that each call after a reset traces them anew.
One traced before and called after raises an error that says so.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import tensorflow as tf
from mpi4py import MPI

from mpi_strategy._src.core import failure, logs, ulfm
from mpi_strategy._src.core.logs import logger
from mpi_strategy._src.core.process import PROCESS
from mpi_strategy._src.features.elastic import recovery, ulfm_exit
from mpi_strategy._src.horovod import basics
from mpi_strategy._src.horovod.basics import global_process_set
from mpi_strategy._src.horovod.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from mpi_strategy._src.horovod.functions import broadcast_object

Result = TypeVar("Result")
Snapshot = list[tuple[Any, np.ndarray]]  # (variable, its value when saved)


class State:
    """What ``run`` brings back after a reset; subclasses say what it holds.

    ``commit()`` saves it in host memory (no communication); ``restore()``
    goes back to the last commit; ``sync()`` (collective over the global
    process set) makes every rank's state rank 0's. ``bcast_object``:
    broadcasts a Python object from rank 0 (``hvd.broadcast_object``);
    ``get_rank``: this process's rank (``hvd.rank``).
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks: list[Callable[[], Any]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Adds functions that ``run`` calls, without arguments and in order,
        after each reset (here: after ranks were lost, once ``hvd.size()``
        is the survivors'), before the state is synchronized: e.g. to scale
        the learning rate with the new number of ranks."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called by ``run`` after a reset, on every rank: ``reset()``, then
        the reset callbacks."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update_res: Any) -> None:
        """Horovod's notification of a change of hosts: none arrive here (no
        elastic driver); does nothing."""

    def commit(self) -> None:
        """Saves the state in host memory (``save``; no communication: every
        rank saves its own, the same on every rank of a correct program), then
        ``check_host_updates``. Commit at the same steps on every rank."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Does nothing: without Horovod's elastic driver no host is added or
        announced as leaving (a lost rank is seen by the collectives instead).
        Never raises ``HostsUpdatedInterrupt``; makes no collective."""

    def save(self) -> None:
        """Saves the state in host memory (the subclass says what)."""
        raise NotImplementedError()

    def restore(self) -> None:
        """Goes back to the last commit (this rank's), undoing later changes."""
        raise NotImplementedError()

    def sync(self) -> None:
        """Makes every rank's state rank 0's (collective over the global set)."""
        raise NotImplementedError()

    def reset(self) -> None:
        """Called after a reset, before the reset callbacks and ``sync``: nothing here."""


class ObjectState(State):
    """A state of Python values: each keyword argument becomes an attribute
    (``state.epoch``), saved by ``commit``, restored by ``restore`` and
    broadcast from rank 0 by ``sync``. Only the attributes named at
    construction are tracked; values are kept as they are (not copied: an
    object changed in place after a commit stays changed)."""

    def __init__(
        self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int], **kwargs: Any
    ) -> None:
        self._saved_state = dict(kwargs)
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        """Saves the tracked attributes' current values (this rank's)."""
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        """Sets the tracked attributes back to their values at the last commit."""
        self._set_attrs()

    def sync(self) -> None:
        """Every rank's last committed values become rank 0's, and so do the
        attributes (one ``bcast_object`` call, collective over the global set;
        none when no attribute is tracked)."""
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)


class TensorFlowState(ObjectState):
    """A state of ``tf.Variable``s (default: ``tf.compat.v1.global_variables()``,
    none in eager mode) and Python values (keyword arguments, as in
    ``ObjectState``). ``commit`` copies the variables' values to host memory,
    ``restore`` assigns them back, ``sync`` gives every rank rank 0's
    variables and values. Eager execution only (``session`` must be None)."""

    def __init__(
        self, variables: Iterable[Any] | None = None, session: Any = None, **kwargs: Any
    ) -> None:
        _require_eager("TensorFlowState", session)
        self.variables = list(variables) if variables else tf.compat.v1.global_variables()
        self.session = session
        self._saved_variables = _snapshot(self.variables)
        super().__init__(bcast_object=broadcast_object, get_rank=basics.rank, **kwargs)

    def save(self) -> None:
        """Copies the variables' values (and the Python values) to host memory."""
        self._saved_variables = _snapshot(self.variables)
        super().save()

    def restore(self) -> None:
        """Assigns the variables their values at the last commit; restores the values."""
        _assign(self._saved_variables)
        super().restore()

    def sync(self) -> None:
        """Assigns every rank rank 0's variables and committed values, and
        saves them as the last commit (collective over the global set)."""
        _broadcast_from_rank_0(self.variables)
        self._saved_variables = _snapshot(self.variables)
        super().sync()


class TensorFlowKerasState(ObjectState):
    """A state of a built Keras ``model``, its ``optimizer`` (default:
    ``model.optimizer``) with its slots, and Python values (keyword
    arguments). The optimizer's slots are created here if it has not made a
    step yet, so that a restore resets them too. ``backend`` is accepted for
    Horovod's TensorFlow 1 path and unused (eager execution only). After a
    reset, Keras traces the model's train, test and predict functions again."""

    def __init__(
        self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any
    ) -> None:
        _require_eager("TensorFlowKerasState", None)
        self.model = model
        if not getattr(model, "built", True):
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.optimizer: Any = optimizer or getattr(model, "optimizer", None)
        if self.optimizer is None:
            raise ValueError(
                "TensorFlowKerasState: no optimizer: pass optimizer=, or compile the model "
                "with one first."
            )
        self.backend = backend
        _build_optimizer(self.optimizer, model)
        self._saved_variables = _snapshot(self._variables())
        super().__init__(bcast_object=broadcast_object, get_rank=basics.rank, **kwargs)

    def _variables(self) -> list[Any]:
        found = self.optimizer.variables
        return [*self.model.variables, *(found() if callable(found) else found)]

    def save(self) -> None:
        """Copies the model's and optimizer's variables (and the Python values)
        to host memory."""
        self._saved_variables = _snapshot(self._variables())
        super().save()

    def restore(self) -> None:
        """Assigns the model's and optimizer's variables their values at the
        last commit; restores the values."""
        _assign(self._saved_variables)
        super().restore()

    def sync(self) -> None:
        """Assigns every rank rank 0's model, optimizer and committed values,
        and saves them as the last commit (collective over the global set)."""
        _broadcast_from_rank_0(self._variables())
        self._saved_variables = _snapshot(self._variables())
        super().sync()

    def reset(self) -> None:
        """Drops the model's traced Keras functions: ``fit`` traces them again
        for the new world (their collectives and size)."""
        for name in ("train_function", "test_function", "predict_function"):
            if getattr(self.model, name, None) is not None:
                setattr(self.model, name, None)


class KerasState(TensorFlowKerasState):
    """``TensorFlowKerasState`` of a ``tf.keras`` model (Horovod's
    ``horovod.tensorflow.keras.elastic.KerasState``)."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, backend=tf.keras.backend, **kwargs)


class CommitStateCallback(tf.keras.callbacks.Callback):
    """Commits ``state`` after every ``batches_per_commit`` training batches
    (counted from the start of each ``fit``) and at the end of every epoch.
    Every rank commits at the same batches (no communication)."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if isinstance(batches_per_commit, bool) or not isinstance(batches_per_commit, int):
            raise TypeError(f"batches_per_commit must be an int, got {batches_per_commit!r}")
        if batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be >= 1, got {batches_per_commit}")
        self.backend = tf.keras.backend
        self.state: Any = state  # with the attributes the callback sets
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.batches_remaining = self.batches_per_commit  # the same on every rank after a reset

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(tf.keras.callbacks.Callback):
    """Sets ``state.batch`` to the index of the training batch just done (in
    its epoch), and to 0 at the end of each epoch. With a known number of
    steps per epoch, the ``steps`` that ``fit`` reports to the callbacks (the
    progress bar) for an epoch begun at ``state.batch`` > 0 is the remainder:
    Keras 3 itself still runs the epoch's full number of steps."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.backend = tf.keras.backend
        self.state: Any = state  # with the attributes the callback sets
        self.steps_per_epoch: int | None = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params.get("steps")
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(tf.keras.callbacks.Callback):
    """Sets ``state.epoch`` at the end of each epoch to the number of epochs
    done in all: ``state.epoch`` when ``fit`` began, plus the epochs of this
    ``fit`` (Keras numbers them from 0 in each call, unless ``initial_epoch``)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.backend = tf.keras.backend
        self.state: Any = state  # with the attributes the callback sets
        self.initial_epoch = 0
        self.on_train_begin()  # state.epoch now

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1


def _require_eager(what: str, session: Any) -> None:
    if session is not None or not tf.executing_eagerly():
        raise NotImplementedError(
            f"hvd.elastic.{what}: TensorFlow 1 graphs and sessions are not supported by "
            "mpi_strategy.horovod's elastic training; run eagerly (TensorFlow 2's default)."
        )


def _build_optimizer(optimizer: Any, model: Any) -> None:
    """Creates a Keras optimizer's slots (momentum, ...) before its first step."""
    if getattr(optimizer, "built", True) is False and callable(getattr(optimizer, "build", None)):
        optimizer.build(model.trainable_variables)


def _snapshot(variables: Iterable[Any]) -> Snapshot:
    """Each variable with a copy of its value in host memory."""
    return [(v, np.array(v.numpy(), copy=True)) for v in variables]


def _assign(saved: Snapshot) -> None:
    for variable, value in saved:
        variable.assign(value)


def _broadcast_from_rank_0(variables: Iterable[Any]) -> None:
    """Assigns each variable its value on rank 0 (one ordered broadcast of the
    global set per variable; Keras 3 variables too)."""
    ordered = global_process_set.comm()
    for variable in variables:
        variable.assign(ordered.broadcast(tf.convert_to_tensor(variable), 0))


# -- run -------------------------------------------------------------------------
def run(func: Callable[..., Result]) -> Callable[..., Result]:
    """Decorator: ``func(state, *args, **kwargs)`` called until it returns
    (every rank returns what it returned on that rank).

    Before each call, ``state.sync()`` gives every rank rank 0's state. When
    ranks are lost (ULFM), every survivor: continues Horovod's global process
    set on the survivors (``hvd.rank()`` and ``hvd.size()`` change; other
    process sets are removed), restores the state's last commit, calls
    ``state.on_reset()`` (its reset callbacks), and calls ``func`` again after
    the sync from the new rank 0. A ``HorovodInternalError`` raised on every
    rank does the same without losing a rank; a ``HostsUpdatedInterrupt``
    raised on every rank skips the restore (and the sync if its
    ``skip_sync``). Any other error goes through, unchanged.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Result:
        basics.check_initialized("hvd.elastic.run")
        _start()
        skip_sync = False
        while True:
            since = failure.lost_mark()
            try:
                if not skip_sync:
                    state.sync()
                with ulfm_exit.exits_seen():
                    return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as interrupt:
                skip_sync = interrupt.skip_sync
            except Exception as error:  # only lost ranks and Horovod's errors: others re-raised
                if _ranks_were_lost(error, since):
                    _continue_on_survivors()
                elif not isinstance(error, HorovodInternalError):
                    raise
                state.restore()
                skip_sync = False
            state.on_reset()

    return wrapper


def _ranks_were_lost(error: BaseException, since: int) -> bool:
    """True if ``error``, raised by code started at ``failure.lost_mark()`` =
    ``since``, comes from a lost rank (``failure.ranks_were_lost``, the rule
    ``elastic.run`` follows too)."""
    ordered = global_process_set.ordered
    return failure.ranks_were_lost(error, [] if ordered is None else [ordered], since)


def _continue_on_survivors() -> None:
    """Shrinks the global set's communicator to the living ranks and continues
    Horovod's global process set there (collective over the survivors)."""
    ordered = global_process_set.comm()
    before, rank_before = ordered.size, ordered.rank
    survivors, _ = recovery.retire_and_shrink(
        ordered, functools.partial(_stale, before), basics.continue_on
    )
    logs.set_rank(survivors.Get_rank(), survivors.Get_size())  # rank 0 of the survivors speaks
    logger.warning(
        "mpi_strategy.horovod.elastic: lost %d rank(s); continuing on %d from the last "
        "commit (rank %d of %d is now rank %d)",
        before - survivors.Get_size(),
        survivors.Get_size(),
        rank_before,
        before,
        survivors.Get_rank(),
    )


class StaleCollectiveError(recovery.StaleCollectiveError):
    """A collective of a ``tf.function`` traced before ``hvd.elastic.run``'s
    reset, on the communicator of before it."""


StaleCollectiveError.__module__ = "mpi_strategy.horovod.tensorflow.elastic"  # its public name


def _stale(size: int) -> StaleCollectiveError:
    return StaleCollectiveError(
        f"mpi_strategy.horovod.elastic: a collective ran on the {size}-rank "
        "communicator of before the last reset, from a tf.function traced before it. "
        "A traced function keeps the collectives and the world size (hvd.Average "
        "divides by it) of its trace: build the tf.functions (and Keras models' "
        "train functions) that call Horovod collectives inside the function decorated "
        "by hvd.elastic.run, so that each call after a reset traces them anew."
    )


# -- the start and the end of an elastic program -------------------------------------


@dataclass
class HorovodElasticState:
    """The warning about elastic runs without ULFM was given (``PROCESS.of``)."""

    warned: bool = False


def _start() -> None:
    """Under ULFM, asks for the library's end without MPI_Finalize over the
    global set's living ranks (``features/elastic/ulfm_exit.py``); without it,
    says once that a lost rank ends the job."""
    if ulfm.ulfm_launch():
        ulfm_exit.end_without_finalize(_living)
    elif basics.size() > 1 and not PROCESS.of(HorovodElasticState).warned:
        PROCESS.of(HorovodElasticState).warned = True
        logger.warning(
            "mpi_strategy.horovod.elastic: this launch has no User-Level Failure "
            "Mitigation: a lost rank ends the job. For elastic training, launch with "
            "Open MPI 5's `mpirun --with-ft ulfm`."
        )


def _living() -> MPI.Intracomm:
    ordered = global_process_set.comm()
    return ordered.comm
