"""Every private Keras symbol mpi_strategy touches, and why (Keras 3 and tf_keras).

Keras assembles ``predict`` outputs and builds its callback list from private
module-level functions. Two small wrappers make them behave under MPIStrategy
as a single-process user expects:

* ``predict`` returns every row of the input, in input order, on every rank
  (Keras only concatenates the local replicas' rows otherwise);
* on ranks other than 0, the progress bar is off and callbacks whose only
  effect is to write files (ModelCheckpoint, TensorBoard, CSVLogger) are
  dropped; Keras 3's BackupAndRestore still restores there but never writes
  (tf_keras's ModelCheckpoint and BackupAndRestore handle this themselves and
  run on every rank). Every other callback (EarlyStopping, ReduceLROnPlateau,
  ...) runs on every rank and sees the same logs, so all ranks decide alike.

The wrappers act only for models whose strategy is an MPIStrategy. If a Keras
release moves these symbols, the wrappers are skipped with a warning: training
is unaffected; predict returns local rows and every rank prints progress.
"""

import importlib
import sys
from typing import NamedTuple

import tensorflow as tf

from mpi_strategy.logs import logger


class _Site(NamedTuple):
    """Where one Keras implementation keeps what is wrapped."""
    trainer: str                # module defining reduce_per_replica
    callback_list: str          # module defining CallbackList
    callbacks: str              # public callbacks module
    rank0_only: tuple           # callbacks dropped on other ranks
    restore_only_backup: bool   # BackupAndRestore only restores on other ranks


_KERAS_SITES = {
    # Keras 3 knows nothing of multi-worker training.
    "keras": _Site("keras.src.backend.tensorflow.trainer", "keras.src.callbacks.callback_list",
                   "keras.callbacks", ("ModelCheckpoint", "TensorBoard", "CSVLogger"), True),
    # tf_keras's ModelCheckpoint and BackupAndRestore already write on the chief
    # only (other ranks write to temporary directories), and must run everywhere.
    "tf_keras": _Site("tf_keras.src.engine.training", "tf_keras.src.callbacks",
                      "tf_keras.callbacks", ("TensorBoard", "CSVLogger"), False),
}
_PATCHED = "_mpi_strategy_wrapped"


def install_for_imported_kerases(strategy_class):
    """Wraps the Keras implementations that this process has imported (idempotent)."""
    for package, site in _KERAS_SITES.items():
        if package not in sys.modules:
            continue  # imported later: wrapped at the next strategy.scope()
        try:
            _wrap_reduce_per_replica(importlib.import_module(site.trainer), strategy_class)
            _wrap_callback_list(site, strategy_class)
        except (ImportError, AttributeError) as exc:  # pragma: no cover - other Keras
            logger.warning(
                "could not adapt %s (%s): predict() returns only this "
                "rank's rows and every rank prints progress.", package, exc)


def _wrap_reduce_per_replica(trainer_module, strategy_class):
    original = trainer_module.reduce_per_replica
    if getattr(original, _PATCHED, False):
        return

    def reduce_per_replica(values, strategy, reduction):
        if reduction == "concat" and isinstance(strategy, strategy_class):
            return tf.nest.map_structure(lambda v: concat_in_input_order(v, strategy), values)
        return original(values, strategy, reduction)

    setattr(reduce_per_replica, _PATCHED, True)
    trainer_module.reduce_per_replica = reduce_per_replica


def concat_in_input_order(value, strategy):
    """All replicas' rows of one predict step, in the order of the input batch.

    A distributed batch gives rank k's local replica l the piece
    ``l * ranks + k`` (see MPIStrategy input sharding); gathering rank-major
    and taking every ``local``-th piece restores the batch order.
    """
    local = len(strategy.extended.worker_devices)
    rows = strategy.gather(value, axis=0)
    if local == 1:
        return rows  # pieces are already in rank (= batch) order
    sizes = strategy.gather(
        strategy.run(lambda v: tf.shape(v)[:1], args=(value,)), axis=0)
    pieces = tf.split(rows, sizes, num=strategy.num_replicas_in_sync)
    ordered = [p for first in range(local) for p in pieces[first::local]]
    return tf.concat(ordered, axis=0)


def _wrap_callback_list(site, strategy_class):
    callback_list_class = importlib.import_module(site.callback_list).CallbackList
    original_init = callback_list_class.__init__
    if getattr(original_init, _PATCHED, False):
        return
    callbacks_module = importlib.import_module(site.callbacks)
    rank0_only = tuple(getattr(callbacks_module, name) for name in site.rank0_only)
    backup = callbacks_module.BackupAndRestore

    def __init__(self, callbacks=None, add_history=False, add_progbar=False, model=None,
                 **params):
        strategy = getattr(model, "distribute_strategy", None)
        if isinstance(strategy, strategy_class):
            for c in callbacks or []:
                if isinstance(c, backup) and hasattr(c, "_supported_strategies"):
                    # tf_keras's BackupAndRestore allow-lists strategy classes.
                    c._supported_strategies = tuple(c._supported_strategies) + (strategy_class,)
            if not strategy.extended.should_checkpoint:
                add_progbar = False
                callbacks = [
                    _restore_only(c) if site.restore_only_backup and isinstance(c, backup) else c
                    for c in (callbacks or []) if not isinstance(c, rank0_only)]
        original_init(self, callbacks, add_history=add_history, add_progbar=add_progbar,
                      model=model, **params)

    setattr(__init__, _PATCHED, True)
    callback_list_class.__init__ = __init__


def _restore_only(callback):
    """Makes a BackupAndRestore on a non-chief rank restore at start and never write."""
    for name in dir(callback):
        if name.startswith("on_") and name != "on_train_begin" and callable(getattr(callback, name)):
            setattr(callback, name, _do_nothing)
    return callback


def _do_nothing(*args, **kwargs):
    del args, kwargs
