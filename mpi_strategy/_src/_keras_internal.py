"""Every private Keras symbol mpi_strategy touches, and why (Keras 3 and tf_keras).

Keras assembles ``predict`` outputs and builds its callback list from private
module-level functions, and writes files from private functions and callback
methods. ``features/keras_wrappers.py`` wraps the first two for models whose strategy
is an MPIStrategy (``predict`` returns every row in input order on every
rank; the progress bar shows on rank 0 only); ``features/saving`` makes the
writers in ``SITES[...].write_calls`` write points. tf_keras's own redirection
of non-chief writes to temporary directories (``TF_KERAS_FILE_UTILS``) is
turned off for MPIStrategy: it would have every rank write.
``OVERRIDDEN_METHODS``: private methods of Keras classes that classes of
``horovod/`` override (SyncBatchNormalization, DistributedOptimizer), each
checked by ``check_overridden`` before use: on a Keras that moved one, the
class raises instead of silently not synchronizing.

If a Keras release moves these symbols, the wrappers are skipped with a
warning: training is unaffected; predict returns local rows and every rank
prints progress. Checked on Keras 3.15 and tf_keras 2.16 / 2.21.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from mpi_strategy._src._tf_internal import Instead, WriteCall
from mpi_strategy._src.core.errors import MPIStrategyError
from mpi_strategy._src.core.logs import logger
from mpi_strategy._src.core.process import PROCESS


class Site(NamedTuple):
    """Where one Keras implementation keeps what is wrapped."""

    trainer: str  # module defining reduce_per_replica
    callback_list: str  # module defining CallbackList
    callbacks: str  # public callbacks module
    write_calls: tuple[WriteCall, ...]  # its functions that write files


# What each Keras' ``reduce_per_replica`` makes of reduction="auto" off TPUs
# (the reduction of fit's and evaluate's step outputs): keras/src/backend/
# tensorflow/trainer.py ("mean"), tf_keras/src/engine/training.py ("sum").
AUTO_REDUCTION = {"keras": "mean", "tf_keras": "sum"}


_KERAS3_BACKUP = (
    "backup_dir",
    "_weights_path",
    "_training_metadata_path",
    "_prev_weights_path",
    "_prev_training_metadata_path",
)
_K3_CALLBACKS = "keras.src.callbacks"
SITES = {
    "keras": Site(
        "keras.src.backend.tensorflow.trainer",
        f"{_K3_CALLBACKS}.callback_list",
        "keras.callbacks",
        (
            WriteCall(
                "keras.src.saving.saving_lib", "save_model", "filepath", Instead.MEMORY, "model"
            ),
            # (remote paths go through a local temporary file)
            WriteCall(
                "keras.src.saving.saving_lib",
                "save_weights_only",
                "filepath",
                Instead.SCRATCH,
                "model",
            ),
            WriteCall(
                "keras.src.legacy.saving.legacy_h5_format",
                "save_model_to_hdf5",
                "filepath",
                Instead.H5_MEMORY,
                "model",
            ),
            # (its variables are tracked by the private _tf_trackable)
            WriteCall(
                "keras.src.export.saved_model:ExportArchive",
                "write_out",
                "filepath",
                Instead.MEMORY,
                "self._tf_trackable",
            ),
            WriteCall(
                f"{_K3_CALLBACKS}.model_checkpoint:ModelCheckpoint",
                "_save_model",
                "self.filepath",
                Instead.MEMORY,
                "self.model",
                ("filepath",),
            ),
            WriteCall(
                f"{_K3_CALLBACKS}.backup_and_restore:BackupAndRestore",
                "_save_model",
                "self.backup_dir",
                Instead.MEMORY,
                "self.model",
                _KERAS3_BACKUP,
            ),
            WriteCall(
                f"{_K3_CALLBACKS}.backup_and_restore:BackupAndRestore",
                "on_train_end",
                "self.backup_dir",
                Instead.MEMORY,
                "self.model",
                _KERAS3_BACKUP,
            ),
            WriteCall(
                f"{_K3_CALLBACKS}.csv_logger:CSVLogger",
                "on_train_begin",
                "self.filename",
                Instead.DEVNULL,
                "self.model",
                ("filename",),
            ),
            # (its row is flushed there: complete on every rank when it returns)
            WriteCall(
                f"{_K3_CALLBACKS}.csv_logger:CSVLogger",
                "on_epoch_end",
                "self.filename",
                Instead.SAME,
                "self.model",
            ),
            WriteCall(
                f"{_K3_CALLBACKS}.csv_logger:CSVLogger",
                "on_train_end",
                "self.filename",
                Instead.SAME,
                "self.model",
            ),
            WriteCall(
                f"{_K3_CALLBACKS}.tensorboard:TensorBoard",
                "on_train_end",
                "self.log_dir",
                Instead.SAME,
                "self.model",
            ),
        ),
    ),
    "tf_keras": Site(
        "tf_keras.src.engine.training",
        "tf_keras.src.callbacks",
        "tf_keras.callbacks",
        (
            # (its .keras and .weights.h5 writers open local files only)
            WriteCall(
                "tf_keras.src.saving.saving_lib", "save_model", "filepath", Instead.SCRATCH, "model"
            ),
            WriteCall(
                "tf_keras.src.saving.saving_lib",
                "save_weights_only",
                "filepath",
                Instead.SCRATCH,
                "model",
            ),
            WriteCall(
                "tf_keras.src.saving.legacy.save", "save_model", "filepath", Instead.MEMORY, "model"
            ),
            WriteCall(
                "tf_keras.src.saving.legacy.save",
                "save_weights",
                "filepath",
                Instead.SCRATCH_IF_H5,
                "model",
            ),
            WriteCall(
                "tf_keras.src.saving.legacy.hdf5_format",
                "save_model_to_hdf5",
                "filepath",
                Instead.H5_MEMORY,
                "model",
            ),
            # (the model it backs up is the private _model)
            WriteCall(
                "tf_keras.src.distribute.worker_training_state:WorkerTrainingState",
                "delete_backup",
                "self.write_checkpoint_manager.directory",
                Instead.SKIP,
                "self._model",
            ),
            WriteCall(
                "tf_keras.src.callbacks:CSVLogger",
                "on_train_begin",
                "self.filename",
                Instead.DEVNULL,
                "self.model",
                ("filename",),
            ),
            # (its row is flushed there: complete on every rank when it returns)
            WriteCall(
                "tf_keras.src.callbacks:CSVLogger",
                "on_epoch_end",
                "self.filename",
                Instead.SAME,
                "self.model",
            ),
            WriteCall(
                "tf_keras.src.callbacks:CSVLogger",
                "on_train_end",
                "self.filename",
                Instead.SAME,
                "self.model",
            ),
            WriteCall(
                "tf_keras.src.callbacks:TensorBoard",
                "on_train_end",
                "self.log_dir",
                Instead.SAME,
                "self.model",
            ),
        ),
    ),
}
# tf_keras sends non-chief writes of multi-worker strategies to temporary
# directories (every rank writes); under MPIStrategy the write points decide.
# Its four path functions, and WorkerTrainingState's write manager.
TF_KERAS_FILE_UTILS = "tf_keras.src.distribute.distributed_file_utils"
TF_KERAS_FILE_UTIL_NAMES = (
    "write_dirpath",
    "write_filepath",
    "remove_temp_dirpath",
    "remove_temp_dir_with_filepath",
)
TF_KERAS_TRAINING_STATE = "tf_keras.src.distribute.worker_training_state"
# Keras 3's LossScaleOptimizer (its public check_finite is wrapped), by its
# defining module's path. (tf_keras's checks the all-reduced gradients.)
KERAS3_LOSS_SCALE_OPTIMIZER = "keras.src.optimizers.loss_scale_optimizer:LossScaleOptimizer"
# tf_keras's mixed precision: its policy and LossScaleOptimizer raise unless
# this module's strategy_supports_loss_scaling() (an allow-list of strategy
# classes) is true; its LossScaleOptimizer checks the gradients with its
# _is_all_finite (each rank its shares under shard="gradients").
TF_KERAS_LOSS_SCALING = "tf_keras.src.mixed_precision.loss_scale_optimizer"
TF_KERAS_LOSS_SCALING_CHECKS = ("strategy_supports_loss_scaling", "_is_all_finite")
# tf_keras's BackupAndRestore allow-lists strategy classes in this attribute.
BACKUP_SUPPORTED_STRATEGIES = "_supported_strategies"


class SaveBeforePreemption(NamedTuple):
    """What tf_keras's ``WorkerTrainingState.__init__(model, checkpoint_dir,
    save_freq, save_before_preemption_arg)`` sets when it enables
    ``BackupAndRestore(save_before_preemption=True)`` (on Google Cloud with
    MultiWorkerMirroredStrategy only); features/keras_wrappers.py sets the same under
    MPIStrategy. tf_keras's fit and ``BackupAndRestore`` read them."""

    enabled: str  # WorkerTrainingState: checks for a notice after each batch, resumes mid-epoch
    handler: str  # WorkerTrainingState: its PreemptionCheckpointHandler
    model_handler: str  # the model: the handler whose watch_preemption_scope fit enters


TF_KERAS_SAVE_BEFORE_PREEMPTION = SaveBeforePreemption(
    "_enable_save_before_preemption", "preemption_handler", "_preemption_handler"
)


class OverriddenMethod(NamedTuple):
    """A private method of a Keras class that a class of mpi_strategy overrides."""

    owner: str  # "package.module:Class"
    name: str
    parameters: tuple[str, ...]  # after self, as Keras declares them
    checked: tuple[int, int]  # the newest Keras (major, minor) checked to call it so


# horovod/sync_batch_norm.py: SyncBatchNormalization(keras.layers.BatchNormalization).
# Keras 3's BatchNormalization.call (training) takes the batch's moments from
# this method, (inputs, mask) -> (mean, variance) over every axis but `axis`;
# SyncBatchNormalization computes them over every rank instead.
BATCH_NORM_MOMENTS = OverriddenMethod(
    "keras.src.layers.normalization.batch_normalization:BatchNormalization",
    "_moments",
    ("inputs", "mask"),
    (3, 15),
)
# horovod/sync_batch_norm_tf_keras.py: the same for tf_keras, whose
# BatchNormalization.call (training) takes them from this method through _moments.
TF_KERAS_BATCH_NORM_MOMENTS = OverriddenMethod(
    "tf_keras.src.layers.normalization.batch_normalization:BatchNormalizationBase",
    "_calculate_mean_and_var",
    ("inputs", "reduction_axes", "keep_dims", "mask"),
    (2, 21),
)
# horovod/optimizer.py: Horovod's DistributedOptimizer of a tf_keras legacy
# optimizer (OptimizerV2). Its minimize (tf_keras's train step) takes the
# gradients from this method, which the override reduces over the ranks.
TF_KERAS_LEGACY_COMPUTE_GRADIENTS = OverriddenMethod(
    "tf_keras.src.optimizers.legacy.optimizer_v2:OptimizerV2",
    "_compute_gradients",
    ("loss", "var_list", "grad_loss", "tape"),
    (2, 21),
)
# The same class's aggregation over a strategy's replicas, which
# apply_gradients calls: overridden as Horovod's is (the optimizer's own).
TF_KERAS_LEGACY_AGGREGATE_GRADIENTS = OverriddenMethod(
    "tf_keras.src.optimizers.legacy.optimizer_v2:OptimizerV2",
    "_aggregate_gradients",
    ("grads_and_vars",),
    (2, 21),
)
# features/sharding.py: MPIStrategy(shard="optimizer") wraps Keras 3's
# TFOptimizer._backend_update_step (where the gradients are summed over the
# replicas and the variables updated) and calls the two methods it calls.
KERAS3_TF_OPTIMIZER = "keras.src.backend.tensorflow.optimizer:TFOptimizer"
KERAS3_BASE_OPTIMIZER = "keras.src.optimizers.base_optimizer:BaseOptimizer"
KERAS3_SHARDED_UPDATE = (
    OverriddenMethod(
        KERAS3_TF_OPTIMIZER,
        "_backend_update_step",
        ("grads", "trainable_variables", "learning_rate"),
        (3, 15),
    ),
    OverriddenMethod(
        KERAS3_TF_OPTIMIZER,
        "_distributed_tf_update_step",
        ("distribution", "grads_and_vars", "learning_rate"),
        (3, 15),
    ),
    OverriddenMethod(
        KERAS3_TF_OPTIMIZER, "_all_reduce_sum_gradients", ("grads_and_vars",), (3, 15)
    ),
)
# Keras' legacy .h5 save writes an optimizer's variables through this
# module-level function of each Keras, reading each one whole (a sharded
# optimizer's are gathered for it); its load sets them with the public
# set_weights (wrapped too: each rank keeps what it holds).
H5_OPTIMIZER_WEIGHTS = {
    "keras": "keras.src.legacy.saving.legacy_h5_format",
    "tf_keras": "tf_keras.src.saving.legacy.hdf5_format",
}
H5_SAVE_OPTIMIZER_WEIGHTS = "save_optimizer_weights_to_hdf5_group"
# ... and reads these attributes of an optimizer: its strategy (TFOptimizer)
# and the variables it was built with (set at the end of BaseOptimizer.build,
# before a subclass makes its slots).
KERAS3_OPTIMIZER_STRATEGY = "_distribution_strategy"
# tf_keras's optimizers (shard="optimizer"): _BaseOptimizer.build makes the
# partition; Optimizer.add_variable_from_reference makes each rank's slots;
# Optimizer._distributed_apply_gradients_fn (the merge call applying the
# summed gradients) updates this rank's share and gathers the rest, then lets
# the original do the EMA and the step count, its _update_step made a no-op.
# (Their strategy is in the attribute of KERAS3_OPTIMIZER_STRATEGY too.)
TF_KERAS_OPTIMIZER = "tf_keras.src.optimizers.optimizer:_BaseOptimizer"
# tf_keras's legacy optimizers (OptimizerV2) make their slots here, at their
# first apply_gradients: in a sharding MPIStrategy this raises instead (they
# are not sharded: each rank would hold the whole state, silently).
TF_KERAS_LEGACY_CREATE_WEIGHTS = OverriddenMethod(
    "tf_keras.src.optimizers.legacy.optimizer_v2:OptimizerV2",
    "_create_all_weights",
    ("var_list",),
    (2, 21),
)
TF_KERAS_DISTRIBUTED_OPTIMIZER = "tf_keras.src.optimizers.optimizer:Optimizer"
TF_KERAS_SHARDED_UPDATE = (
    OverriddenMethod(
        TF_KERAS_DISTRIBUTED_OPTIMIZER,
        "add_variable_from_reference",
        ("model_variable", "variable_name", "shape", "initial_value"),
        (2, 21),
    ),
    OverriddenMethod(
        TF_KERAS_DISTRIBUTED_OPTIMIZER,
        "_distributed_apply_gradients_fn",
        ("distribution", "grads_and_vars", "kwargs"),
        (2, 21),
    ),
    OverriddenMethod(TF_KERAS_OPTIMIZER, "_update_step", ("gradient", "variable"), (2, 21)),
    # shard="gradients": the sum over the replicas (a reduce-scatter instead),
    # and the clipping of the sums (done in the step, on the shares).
    OverriddenMethod(
        TF_KERAS_DISTRIBUTED_OPTIMIZER, "aggregate_gradients", ("grads_and_vars",), (2, 21)
    ),
    OverriddenMethod(TF_KERAS_OPTIMIZER, "_clip_gradients", ("grads",), (2, 21)),
)
# ... and, as Keras 3's, enters a shadow in this dict (variable key -> position).
TF_KERAS_OPTIMIZER_INDICES = "_index_dict"
KERAS3_OPTIMIZER_BUILT_WITH = "_trainable_variables"
# Both Kerases' Adafactor.build makes, for each variable of rank >= 2, its
# factored moments (r, then c) by the public add_variable, before that
# variable's slot: features/sharding._factored_moments expects this order
# (checked as they are made: another raises on every rank).
# ... and, to update the rows of a variable a rank holds in part, has the
# optimizer's own update_step look up the slots of those rows: it enters the
# rows' variable in this dict of the optimizer (BaseOptimizer: variable key ->
# position) for the update's duration, keyed by the optimizer's _var_key.
KERAS3_OPTIMIZER_INDICES = "_trainable_variables_indices"
# Elastic training of a sharded optimizer makes its slots again for the
# survivors (features/sharding.rebuild_slots): the variables made before
# BaseOptimizer.build (its __init__'s step count and learning rate, kept) and
# the method that drops a variable from its list (and its tracker's ids).
KERAS3_OPTIMIZER_AT_INIT = ("_iterations", "_learning_rate")
KERAS3_OPTIMIZER_UNTRACK = "_untrack_variable"
# ... and the list it tracks them in (TensorFlow's ListWrapper under the TF
# backend: ``_tf_internal.list_rebuilt_in_order``).
KERAS3_OPTIMIZER_VARIABLES = "_variables"
# ... and of tf_keras's (_BaseOptimizer): the variable its __init__ makes (the
# step count, first in its list), its list of variables (set anew: a tracked
# list cut in place could not be checkpointed), its flag of a build done, the
# children its checkpoint cached (of the old slots), and what Nadam's build
# makes outside its variables (its product of the momentum schedule, advanced
# in its update_step, and the Python count of its updates that tells whether
# the step's product is made already; kept: the elastic state sets the
# product back and the count from the step count, features/sharding._Kind).
TF_KERAS_OPTIMIZER_AT_INIT = ("_iterations",)
TF_KERAS_OPTIMIZER_VARIABLES = "_variables"
TF_KERAS_OPTIMIZER_BUILT = "_built"
TF_KERAS_OPTIMIZER_CHECKPOINT_CHILDREN = "_coalesced_children"
TF_KERAS_NADAM_PRODUCT = "_u_product"
TF_KERAS_NADAM_PRODUCT_COUNT = "_u_product_counter"
OVERRIDDEN_METHODS = (
    BATCH_NORM_MOMENTS,
    TF_KERAS_BATCH_NORM_MOMENTS,
    TF_KERAS_LEGACY_COMPUTE_GRADIENTS,
    TF_KERAS_LEGACY_AGGREGATE_GRADIENTS,
    *KERAS3_SHARDED_UPDATE,
    *TF_KERAS_SHARDED_UPDATE,
)


@dataclass
class KerasWarnings:
    """The overridden methods whose newer Keras was warned about (``PROCESS.of``)."""

    newer_than_checked: set[OverriddenMethod] = field(default_factory=set)


def check_overridden(method: OverriddenMethod) -> None:
    """Raises MPIStrategyError if this Keras has no such method or it takes
    other parameters (an override would then never be called); logs a warning,
    once, if Keras is newer than the release it was checked on."""
    import importlib
    import inspect

    module_name, _, class_name = method.owner.partition(":")
    where = f"{method.owner.replace(':', '.')}.{method.name}"
    try:
        owner = getattr(importlib.import_module(module_name), class_name)
        found = inspect.signature(getattr(owner, method.name))
    except (ImportError, AttributeError, ValueError, TypeError) as exc:
        raise MPIStrategyError(
            f"this Keras has no {where} ({exc}), which mpi_strategy overrides; "
            f"install Keras {method.checked[0]}.{method.checked[1]}"
        ) from exc
    parameters = tuple(found.parameters)[1:]
    if parameters != method.parameters:
        raise MPIStrategyError(
            f"this Keras's {where} takes {parameters}, not {method.parameters}: "
            f"mpi_strategy's override would not be called; install Keras "
            f"{method.checked[0]}.{method.checked[1]}"
        )
    package = importlib.import_module(module_name.partition(".")[0])
    version = tuple(int(p) for p in str(package.__version__).split(".")[:2] if p.isdigit())
    warned = PROCESS.of(KerasWarnings).newer_than_checked
    if version > method.checked and method not in warned:
        warned.add(method)
        logger.warning(
            "mpi_strategy overrides %s, checked up to Keras %d.%d; found %s.",
            where,
            *method.checked,
            package.__version__,
        )
