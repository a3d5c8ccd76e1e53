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
  enables it on Google Cloud only): TensorFlow's PreemptionCheckpointHandler;
* Keras 3's ``LossScaleOptimizer`` skips a step whose gradients overflow on
  any replica, on every rank.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import tensorflow as tf

from mpi_strategy._src._keras_internal import (
    BACKUP_SUPPORTED_STRATEGIES,
    TF_KERAS_SAVE_BEFORE_PREEMPTION,
)
from mpi_strategy._src.core.process import PROCESS
from mpi_strategy._src.distribute.strategy import MPIStrategy


@dataclass
class _MergeResults:
    """The tensors that merge_call returned to an MPIStrategy's replicas (by id):
    the same on every replica, as MirroredStrategy's replicas share one object."""

    tensors: weakref.WeakValueDictionary[int, Any] = field(
        default_factory=weakref.WeakValueDictionary
    )


def merge_call_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """MirroredStrategy's replica context ``_merge_call``: what it returns to an
    MPIStrategy's replica is remembered as the same on every replica (tf_keras'
    metric results are), so that ``reduce_per_replica`` leaves it as
    MirroredStrategy does (there, every replica gets the one object)."""

    @functools.wraps(original)
    def _merge_call(self: Any, fn: Any, args: Any, kwargs: Any) -> Any:
        result = original(self, fn, args, kwargs)
        if isinstance(self.strategy, MPIStrategy):
            shared = PROCESS.of(_MergeResults).tensors
            for leaf in tf.nest.flatten(result):
                if tf.is_tensor(leaf):
                    shared[id(leaf)] = leaf
        return result

    return _merge_call


def _same_on_every_replica(value: Any) -> bool:
    # A variable (a metric's result may be its state, Keras 3's or tf_keras's) is
    # one object on every replica too: Keras reads it later, aggregated.
    if callable(getattr(value, "assign", None)):
        return True
    return PROCESS.of(_MergeResults).tensors.get(id(value)) is value


def reduce_per_replica_wrapper(original: Callable[..., Any], auto: str) -> Callable[..., Any]:
    """Keras' ``reduce_per_replica`` (whose reduction="auto" is ``auto``): for
    an MPIStrategy, every rank gets what MirroredStrategy gives over as many
    devices, reduced over all ranks' replicas: the outputs of fit's and
    evaluate's steps (metric results or not), predict's rows in input order."""

    @functools.wraps(original)
    def reduce_per_replica(values: Any, strategy: Any, reduction: str) -> Any:
        if not isinstance(strategy, MPIStrategy) or strategy.num_replicas_in_sync == 1:
            return original(values, strategy, reduction)  # (one replica: nothing is reduced)
        reduction = auto if reduction == "auto" else reduction
        if reduction not in ("sum", "mean", "first", "concat"):
            return original(values, strategy, reduction)  # Keras' own error
        leaves = tf.nest.flatten(values)
        at = [
            i
            for i, v in enumerate(leaves)
            if (tf.is_tensor(v) or _per_replica(v)) and not _same_on_every_replica(v)
        ]
        if not at:
            return values
        if reduction in ("sum", "mean"):
            # One batch reduction for all (Keras' logs: a few scalars per step).
            sums = strategy.reduce("SUM", [leaves[i] for i in at], axis=None)
            finish = _sum_of_elements if reduction == "sum" else _over_replicas(strategy)
            reduced = [finish(s) for s in sums]
        else:
            gather = _first if reduction == "first" else _concat
            reduced = [gather(leaves[i], strategy) for i in at]
        for i, r in zip(at, reduced):
            leaves[i] = r
        return tf.nest.pack_sequence_as(values, leaves)

    return reduce_per_replica


def check_finite_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """Keras 3's ``LossScaleOptimizer.check_finite`` under an MPIStrategy of
    several replicas: true on every replica only if every replica's gradients
    are finite, as the summed gradients of one process on the global batch
    are. (Keras takes each process's first replica's answer: one rank would
    apply the step, and all-reduce, while another skipped it.)"""

    @functools.wraps(original)
    def check_finite(self: Any, grads: Any) -> Any:
        strategy = tf.distribute.get_strategy()
        if not isinstance(strategy, MPIStrategy) or strategy.num_replicas_in_sync == 1:
            return original(self, grads)
        return _finite_on_every_replica(original(self, grads))

    return check_finite


def _finite_on_every_replica(finite: Any) -> Any:
    """``finite`` (this replica's answer) and'ed over every replica (in a
    replica context; elsewhere as it is)."""
    context = tf.distribute.get_replica_context()
    if context is None:
        return finite
    overflowed = context.all_reduce("SUM", tf.cast(tf.logical_not(finite), tf.int32))
    return tf.equal(overflowed, 0)


def tf_keras_supports_loss_scaling_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """tf_keras's ``strategy_supports_loss_scaling`` (which its mixed precision
    policy and ``LossScaleOptimizer`` ask, and raise on): true in an
    MPIStrategy, which synchronizes as the MirroredStrategy it allows."""

    @functools.wraps(original)
    def strategy_supports_loss_scaling() -> bool:
        if isinstance(tf.distribute.get_strategy(), MPIStrategy):
            return True
        return bool(original())

    return strategy_supports_loss_scaling


def tf_keras_is_all_finite_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """tf_keras's ``LossScaleOptimizer`` check of the gradients (``_is_all_finite``)
    under ``MPIStrategy(shard="gradients")``, where each rank checks its
    share of the summed gradients: true on every replica only if every share
    is finite, as the summed gradients of the unsharded run are (else the ranks
    would not agree on skipping the step)."""

    @functools.wraps(original)
    def _is_all_finite(grads: Any) -> Any:
        strategy = tf.distribute.get_strategy()
        if not (
            isinstance(strategy, MPIStrategy)
            and strategy.extended.shard == "gradients"
            and strategy.num_replicas_in_sync > 1
        ):
            return original(grads)
        return _finite_on_every_replica(original(grads))

    return _is_all_finite


def _per_replica(value: Any) -> bool:
    return isinstance(value, tf.distribute.DistributedValues)


def _sum_of_elements(total: tf.Tensor) -> tf.Tensor:
    # Keras' "sum" is tf.reduce_sum of the stacked replicas' values: every element.
    return tf.reduce_sum(total)


def _over_replicas(strategy: MPIStrategy) -> Callable[[tf.Tensor], tf.Tensor]:
    # Keras' "mean" is tf.reduce_mean over the replicas (an integer mean truncates).
    def mean(total: tf.Tensor) -> tf.Tensor:
        count = tf.constant(strategy.num_replicas_in_sync, total.dtype)
        return tf.truncatediv(total, count) if total.dtype.is_integer else total / count

    return mean


def _first(value: Any, strategy: MPIStrategy) -> tf.Tensor:
    # Replica 0 of all: rank 0's first device.
    return strategy.gather(_with_rows(value, strategy), axis=0)[0]


def _concat(value: Any, strategy: MPIStrategy) -> tf.Tensor:
    # Scalars are stacked, as Keras' concat does.
    scalar = strategy.experimental_local_results(value)[0].shape.rank == 0
    return concat_in_input_order(_with_rows(value, strategy) if scalar else value, strategy)


def _with_rows(value: Any, strategy: MPIStrategy) -> Any:
    return strategy.run(lambda v: v[tf.newaxis], args=(value,))


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
