"""Keras under MPIStrategy as one process sees it (Keras 3 and tf_keras).

What the wrappers below do, for models whose strategy is an MPIStrategy
(``effects.py`` installs them over the private symbols that
``_keras_internal`` lists; any other model gets Keras' own behaviour):

* ``predict`` returns every row of the input, in input order, on every rank
  (Keras only concatenates the local replicas' rows otherwise);
* on ranks other than 0, the progress bar is off. Every callback runs on
  every rank and sees the same logs, so all ranks decide alike; the files
  they write are written once per filesystem (``features/saving``);
* tf_keras's redirection of non-chief writes to temporary directories is
  off: every rank names the real path, and the write points decide who writes;
* tf_keras's ``BackupAndRestore(save_before_preemption=True)`` works (tf_keras
  enables it on Google Cloud only): TensorFlow's PreemptionCheckpointHandler.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from mpi_strategy._src._keras_internal import (
    BACKUP_SUPPORTED_STRATEGIES,
    TF_KERAS_SAVE_BEFORE_PREEMPTION,
)
from mpi_strategy._src.distribute.strategy import MPIStrategy


def reduce_per_replica_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """Keras' ``reduce_per_replica``, with predict's "concat" in input order."""

    @functools.wraps(original)
    def reduce_per_replica(values: Any, strategy: Any, reduction: str) -> Any:
        if reduction == "concat" and isinstance(strategy, MPIStrategy):
            return tf.nest.map_structure(lambda v: concat_in_input_order(v, strategy), values)
        return original(values, strategy, reduction)

    return reduce_per_replica


def concat_in_input_order(value: Any, strategy: MPIStrategy) -> tf.Tensor:
    """All replicas' rows of one predict step, in the order of the input batch.

    A distributed batch gives rank k's local replica l the piece
    ``l * ranks + k`` (see MPIStrategy input sharding); gathering rank-major
    and taking every ``local``-th piece restores the batch order.
    """
    local = len(strategy.extended.worker_devices)
    rows = strategy.gather(value, axis=0)
    if local == 1:
        return rows  # pieces are already in rank (= batch) order
    sizes = strategy.gather(strategy.run(lambda v: tf.shape(v)[:1], args=(value,)), axis=0)
    pieces = tf.split(rows, sizes, num=strategy.num_replicas_in_sync)
    ordered = [p for first in range(local) for p in pieces[first::local]]
    return tf.concat(ordered, axis=0)


def callback_list_init_wrapper(
    original_init: Callable[..., None], backup_class: type
) -> Callable[..., None]:
    """``CallbackList.__init__``: the progress bar on rank 0 only, and tf_keras's
    ``BackupAndRestore`` (``backup_class``) accepting MPIStrategy."""

    @functools.wraps(original_init)
    def __init__(
        self: Any,
        callbacks: Any = None,
        add_history: bool = False,
        add_progbar: bool = False,
        model: Any = None,
        **params: Any,
    ) -> None:
        strategy = getattr(model, "distribute_strategy", None)
        if isinstance(strategy, MPIStrategy):
            for c in callbacks or []:
                if isinstance(c, backup_class) and hasattr(c, BACKUP_SUPPORTED_STRATEGIES):
                    supported = tuple(getattr(c, BACKUP_SUPPORTED_STRATEGIES))
                    setattr(c, BACKUP_SUPPORTED_STRATEGIES, (*supported, MPIStrategy))
            add_progbar = add_progbar and strategy.extended.should_checkpoint
        original_init(
            self, callbacks, add_history=add_history, add_progbar=add_progbar, model=model, **params
        )

    return __init__


def training_state_init_wrapper(original_init: Callable[..., None]) -> Callable[..., None]:
    """tf_keras's ``WorkerTrainingState.__init__``: under MPIStrategy every rank
    saves the chief's backup (a write point), not a temporary copy; and
    ``BackupAndRestore(save_before_preemption=True)``, which tf_keras enables
    on Google Cloud with MultiWorkerMirroredStrategy only, is on: TensorFlow's
    PreemptionCheckpointHandler over that one backup, on every rank
    (``features/preemption``: a notice on any rank, every rank saves after the
    same step and exits with 42; restarted, fit goes on from the next step)."""

    @functools.wraps(original_init)
    def __init__(
        self: Any,
        model: Any,
        checkpoint_dir: str,
        save_freq: Any = "epoch",
        save_before_preemption_arg: Any = None,
    ) -> None:
        if not isinstance(model.distribute_strategy, MPIStrategy):
            original_init(self, model, checkpoint_dir, save_freq, save_before_preemption_arg)
            return
        # (tf_keras would not enable it here; built below, over the chief's backup)
        original_init(self, model, checkpoint_dir, save_freq, None)
        self.write_checkpoint_manager = self.read_checkpoint_manager
        if save_before_preemption_arg:
            _save_before_preemption(self, model)

    return __init__


def _save_before_preemption(state: Any, model: Any) -> None:
    """What tf_keras's ``WorkerTrainingState`` sets up when it supports the
    platform, with the one backup every rank restores and saves. The handler
    restores that backup now (epoch, batch and weights)."""
    handler = tf.distribute.experimental.PreemptionCheckpointHandler(
        model.distribute_strategy.cluster_resolver, state.read_checkpoint_manager
    )
    setattr(state, TF_KERAS_SAVE_BEFORE_PREEMPTION.enabled, True)
    setattr(state, TF_KERAS_SAVE_BEFORE_PREEMPTION.handler, handler)
    setattr(model, TF_KERAS_SAVE_BEFORE_PREEMPTION.model_handler, handler)


def file_util_wrapper(original: Callable[..., Any], name: str) -> Callable[..., Any]:
    """One of tf_keras's ``distributed_file_utils`` functions (``name``): under
    MPIStrategy every rank names the real path, and no temporary directory
    is removed."""
    in_place = (lambda path: path) if name.startswith("write_") else (lambda path: None)

    @functools.wraps(original)
    def file_util(path: Any, strategy: Any) -> Any:
        if isinstance(strategy, MPIStrategy):
            return in_place(path)
        return original(path, strategy)

    return file_util
