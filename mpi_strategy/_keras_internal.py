"""Every private Keras symbol mpi_strategy touches, and why (Keras 3 and tf_keras).

Keras assembles ``predict`` outputs and builds its callback list from private
module-level functions. Two small wrappers make them behave under MPIStrategy
as a single-process user expects:

* ``predict`` returns every row of the input, in input order, on every rank
  (Keras only concatenates the local replicas' rows otherwise);
* on ranks other than 0, the progress bar is off. Every callback runs on
  every rank and sees the same logs, so all ranks decide alike; the files
  they write (ModelCheckpoint, BackupAndRestore, TensorBoard, CSVLogger) are
  written once per filesystem, because the Keras functions and callback
  methods listed in ``_KERAS_SITES`` are write points (``saving.py``). tf_keras's own
  redirection of non-chief writes to temporary directories is turned off for
  MPIStrategy: it would have every rank write.

The wrappers act only for models whose strategy is an MPIStrategy. If a Keras
release moves these symbols, the wrappers are skipped with a warning: training
is unaffected; predict returns local rows and every rank prints progress.
"""

import importlib
import sys
from typing import NamedTuple

import tensorflow as tf

from mpi_strategy import saving
from mpi_strategy.logs import logger


class _Site(NamedTuple):
    """Where one Keras implementation keeps what is wrapped."""
    trainer: str                # module defining reduce_per_replica
    callback_list: str          # module defining CallbackList
    callbacks: str              # public callbacks module
    write_calls: tuple          # saving.WriteCall fields of its functions that write files


_KERAS3_BACKUP = ("backup_dir", "_weights_path", "_training_metadata_path",
                  "_prev_weights_path", "_prev_training_metadata_path")
_KERAS_SITES = {
    "keras": _Site(
        "keras.src.backend.tensorflow.trainer", "keras.src.callbacks.callback_list",
        "keras.callbacks", (
            ("keras.src.saving.saving_lib", "save_model", "filepath", "memory"),
            # (remote paths go through a local temporary file)
            ("keras.src.saving.saving_lib", "save_weights_only", "filepath", "scratch"),
            ("keras.src.legacy.saving.legacy_h5_format", "save_model_to_hdf5", "filepath",
             "h5_memory"),
            ("keras.src.export.saved_model:ExportArchive", "write_out", "filepath", "memory"),
            ("keras.src.callbacks.model_checkpoint:ModelCheckpoint", "_save_model",
             "self.filepath", "memory", ("filepath",)),
            ("keras.src.callbacks.backup_and_restore:BackupAndRestore", "_save_model",
             "self.backup_dir", "memory", _KERAS3_BACKUP),
            ("keras.src.callbacks.backup_and_restore:BackupAndRestore", "on_train_end",
             "self.backup_dir", "memory", _KERAS3_BACKUP),
            ("keras.src.callbacks.csv_logger:CSVLogger", "on_train_begin", "self.filename",
             "devnull", ("filename",)),
            ("keras.src.callbacks.csv_logger:CSVLogger", "on_train_end", "self.filename", "same"),
            ("keras.src.callbacks.tensorboard:TensorBoard", "on_train_end", "self.log_dir",
             "same"),
        )),
    "tf_keras": _Site(
        "tf_keras.src.engine.training", "tf_keras.src.callbacks", "tf_keras.callbacks", (
            # (its .keras and .weights.h5 writers open local files only)
            ("tf_keras.src.saving.saving_lib", "save_model", "filepath", "scratch"),
            ("tf_keras.src.saving.saving_lib", "save_weights_only", "filepath", "scratch"),
            ("tf_keras.src.saving.legacy.save", "save_model", "filepath", "memory"),
            ("tf_keras.src.saving.legacy.save", "save_weights", "filepath", "scratch_if_h5"),
            ("tf_keras.src.saving.legacy.hdf5_format", "save_model_to_hdf5", "filepath",
             "h5_memory"),
            ("tf_keras.src.distribute.worker_training_state:WorkerTrainingState",
             "delete_backup", "self.write_checkpoint_manager.directory", "skip"),
            ("tf_keras.src.callbacks:CSVLogger", "on_train_begin", "self.filename", "devnull",
             ("filename",)),
            ("tf_keras.src.callbacks:CSVLogger", "on_train_end", "self.filename", "same"),
            ("tf_keras.src.callbacks:TensorBoard", "on_train_end", "self.log_dir", "same"),
        )),
}
# tf_keras sends non-chief writes of multi-worker strategies to temporary
# directories (every rank writes); under MPIStrategy the write points decide.
_TF_KERAS_FILE_UTILS = "tf_keras.src.distribute.distributed_file_utils"
_TF_KERAS_TRAINING_STATE = "tf_keras.src.distribute.worker_training_state"
_PATCHED = "_mpi_strategy_wrapped"


def install_for_imported_kerases(strategy_class, multi_rank):
    """Wraps the Keras implementations that this process has imported (idempotent).

    ``multi_rank``: the strategy spans several ranks, so saving must be adapted too.
    """
    for package, site in _KERAS_SITES.items():
        if package not in sys.modules:
            continue  # imported later: wrapped at the next strategy.scope()
        try:
            _wrap_reduce_per_replica(importlib.import_module(site.trainer), strategy_class)
            _wrap_callback_list(site, strategy_class)
            if multi_rank:
                saving.install(site.write_calls)
                if package == "tf_keras":
                    _write_in_place(importlib.import_module(_TF_KERAS_FILE_UTILS),
                                    strategy_class)
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
    backup = importlib.import_module(site.callbacks).BackupAndRestore

    def __init__(self, callbacks=None, add_history=False, add_progbar=False, model=None,
                 **params):
        strategy = getattr(model, "distribute_strategy", None)
        if isinstance(strategy, strategy_class):
            for c in callbacks or []:
                if isinstance(c, backup) and hasattr(c, "_supported_strategies"):
                    # tf_keras's BackupAndRestore allow-lists strategy classes.
                    c._supported_strategies = tuple(c._supported_strategies) + (strategy_class,)
            add_progbar = add_progbar and strategy.extended.should_checkpoint
        original_init(self, callbacks, add_history=add_history, add_progbar=add_progbar,
                      model=model, **params)

    setattr(__init__, _PATCHED, True)
    callback_list_class.__init__ = __init__


def _write_in_place(file_utils, strategy_class):
    """tf_keras's distributed_file_utils, for MPIStrategy: every rank names the real
    path; and BackupAndRestore's training state: every rank saves the chief's backup."""
    if getattr(file_utils.write_dirpath, _PATCHED, False):
        return
    state_class = importlib.import_module(_TF_KERAS_TRAINING_STATE).WorkerTrainingState
    original_init = state_class.__init__

    def __init__(self, model, *args, **kwargs):
        original_init(self, model, *args, **kwargs)
        if isinstance(model.distribute_strategy, strategy_class):
            self.write_checkpoint_manager = self.read_checkpoint_manager

    state_class.__init__ = __init__
    for name, in_place in (("write_dirpath", lambda path: path),
                           ("write_filepath", lambda path: path),
                           ("remove_temp_dirpath", lambda path: None),
                           ("remove_temp_dir_with_filepath", lambda path: None)):
        original = getattr(file_utils, name)

        def replacement(path, strategy, original=original, in_place=in_place):
            if isinstance(strategy, strategy_class):
                return in_place(path)
            return original(path, strategy)

        setattr(replacement, _PATCHED, True)
        setattr(file_utils, name, replacement)
