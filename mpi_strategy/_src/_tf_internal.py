"""Every private TensorFlow symbol mpi_strategy uses, behind one version check.

TensorFlow's distribute internals move between releases. Keeping each private
import here, and the name of every private hook of a TensorFlow base class
that the binding overrides (``OVERRIDDEN_HOOKS``, each checked to exist at
import), means a new TF release breaks (at most) this file, loudly, at import
time, instead of somewhere deep inside a training step.

Checked on TensorFlow 2.16.2 (with Keras 3.15) and 2.21.0 (CI runs both).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import tensorflow as tf

from mpi_strategy._src.core.errors import MPIStrategyError
from mpi_strategy._src.core.logs import logger

SUPPORTED_TF = ((2, 16), (2, 21))  # inclusive range this file was checked against


def _tf_version() -> tuple[int, ...]:
    return tuple(int(p) for p in tf.__version__.split(".")[:2])


_version = _tf_version()
if _version < SUPPORTED_TF[0]:
    raise MPIStrategyError(
        f"mpi_strategy needs TensorFlow >= {'.'.join(map(str, SUPPORTED_TF[0]))}; "
        f"found {tf.__version__}. Upgrade with: pip install -U 'tensorflow>=2.16'"
    )
if _version > SUPPORTED_TF[1]:
    logger.warning(
        "mpi_strategy was tested with TensorFlow up to %s; found %s. "
        "If something fails in mpi_strategy/_src/_tf_internal.py, TensorFlow's "
        "private distribute API changed.",
        ".".join(map(str, SUPPORTED_TF[1])),
        tf.__version__,
    )

try:
    from tensorflow.python import tf2 as _tf2
    from tensorflow.python.checkpoint.sharding import sharding_policies as _sharding_policies
    from tensorflow.python.data.ops import multi_device_iterator_ops as _multi_device_iterator_ops
    from tensorflow.python.distribute import (
        cross_device_ops as _cross_device_ops,
        distribute_utils as _distribute_utils,
        input_lib as _input_lib,
        input_util as _input_util,
        mirrored_run as _mirrored_run,
        mirrored_strategy as _mirrored_strategy,
    )
    from tensorflow.python.framework import ops as _ops
    from tensorflow.python.ops import (
        control_flow_util as _control_flow_util,
        gen_dataset_ops as _gen_dataset_ops,
        resource_variable_ops as _resource_variable_ops,
    )
    from tensorflow.python.trackable import (
        base as _trackable_base,
        data_structures as _data_structures,
        trackable_utils as _trackable_utils,
    )
    from tensorflow.python.training.saving import saveable_object as _saveable_object
except ImportError as exc:  # pragma: no cover - only on an untested TF
    raise MPIStrategyError(
        f"TensorFlow {tf.__version__} moved a private module mpi_strategy relies "
        f"on ({exc}). Install a TensorFlow between 2.16 and 2.21."
    ) from exc

# The single-process mirrored machinery MPIStrategy extends across ranks.
MirroredExtended = _mirrored_strategy.MirroredExtended
regroup = _distribute_utils.regroup
simple_broadcast = _cross_device_ops.simple_broadcast
get_distributed_dataset = _input_util.get_distributed_dataset
get_distributed_datasets_from_function = _input_util.get_distributed_datasets_from_function
# What those two build under TF2 (distribute/datasets.py subclasses them).
DistributedDataset = _input_lib.DistributedDataset
DistributedDatasetsFromFunction = _input_lib.DistributedDatasetsFromFunction
# A sharded optimizer's slot placeholder (distribute/sharding.py) is a
# ResourceVariable whose checkpoint value is a SaveSpec of None (recorded in the
# object graph, written by no one here: functional_saver's _single_shard_save),
# under the key every variable's value has. A sharded save keeps TF's own
# sharding of the tensors it sees (the default policy, one shard per device task).
ResourceVariable = _resource_variable_ops.ResourceVariable
SaveSpec = _saveable_object.SaveSpec
VARIABLE_VALUE_KEY = _trackable_base.VARIABLE_VALUE_KEY
ShardByTaskPolicy = _sharding_policies.ShardByTaskPolicy


def record_shape_in_saved_model(variable: Any, shape: tf.TensorShape) -> None:
    """Makes ``tf.saved_model.save`` record ``variable`` (a ResourceVariable,
    which may hold part of a value, or none) as a variable of ``shape``, the
    value its checkpoint key holds, so that ``tf.saved_model.load`` makes one
    it can restore. Wraps the instance's ``_write_object_proto`` (which
    ResourceVariable's subclasses may override), then sets ``variable.shape``
    in its SavedObject proto."""
    write = variable._write_object_proto

    def write_whole(proto: Any, options: Any) -> None:
        write(proto, options)
        proto.variable.shape.CopyFrom(tf.TensorShape(shape).as_proto())

    object.__setattr__(variable, "_write_object_proto", write_whole)


def saver_root(saver: Any) -> Any:
    """The object a ``TrackableSaver`` saves (its graph view's root)."""
    return saver._graph_view.root


def value_keys(saver: Any) -> Iterator[tuple[Any, str]]:
    """(object, the checkpoint key of its value if it is a variable) for every
    object a ``TrackableSaver`` saves (its graph view's traversal, as its save
    names them)."""
    _, paths = saver._graph_view.breadth_first_traversal()
    for obj, path in paths.items():
        name = _trackable_utils.object_path_to_string(path)
        yield obj, _trackable_utils.checkpoint_key(name, VARIABLE_VALUE_KEY)


def list_rebuilt_in_order(tracked: Any) -> None:
    """Marks a tracked list (a ``ListWrapper``) whose items were removed, then
    appended again in the order of its first build, as saveable again:
    TensorFlow refuses to save a list once an item left it (a checkpoint keys
    its items by position), and a list rebuilt so has each item at the
    position a fresh build gives it (``features/sharding.rebuild_slots``)."""
    if isinstance(tracked, _data_structures.ListWrapper):
        tracked._non_append_mutation = False
        tracked._update_snapshot()  # (the list as it is now: not modified since)


def tf2_enabled() -> bool:
    return _tf2.enabled()


class MultiDeviceReader(NamedTuple):
    """One worker's OwnedMultiDeviceIterator of a DistributedIterator."""

    owner: Any  # the OwnedMultiDeviceIterator (Python object)
    resource: Any  # its MultiDeviceIterator resource handle
    dataset: tf.data.Dataset  # the worker's dataset it reads
    device: str  # where the resource lives (the worker's host)


def multi_device_readers(iterator: Any) -> Iterator[MultiDeviceReader]:
    """Each worker's OwnedMultiDeviceIterator of a DistributedIterator (none for
    other iterators). Reads DistributedIterator._iterators, then each
    _SingleWorkerOwnedDatasetIterator's _iterator and _dataset, then
    OwnedMultiDeviceIterator's _multi_device_iterator_resource and _source_device."""
    for worker_iterator in getattr(iterator, "_iterators", ()):
        owned = getattr(worker_iterator, "_iterator", None)
        if isinstance(owned, _multi_device_iterator_ops.OwnedMultiDeviceIterator):
            yield MultiDeviceReader(
                owned,
                owned._multi_device_iterator_resource,
                worker_iterator._dataset,
                owned._source_device,
            )


def reinitialize_multi_device_iterator(resource: Any, dataset: tf.data.Dataset) -> None:
    """Points a multi-device iterator at ``dataset``: its current buffer is
    reset first (the prefetch thread cancelled and joined), as
    OwnedMultiDeviceIterator's constructor initialises it (MultiDeviceIteratorInit)."""
    _gen_dataset_ops.multi_device_iterator_init(
        dataset._variant_tensor, resource, max_buffer_size=1
    )


def in_xla_context() -> bool:
    """True when the op being built will be compiled by XLA (jit_compile=True)."""
    return _control_flow_util.GraphOrParentsInXlaContext(_ops.get_default_graph())


def is_mirrored(value: Any) -> bool:
    return _distribute_utils.is_mirrored(value)


def captured_value(tensor: Any) -> Any:
    """What a placeholder of a tf.function's graph stands for: a tensor of the
    enclosing graph, or an eager tensor such as a variable's handle; None if
    ``tensor`` is not such a capture. (FuncGraph.captures.)"""
    for external, internal in getattr(tensor.graph, "captures", ()):
        if internal is tensor:
            return external
    return None


# Private hooks of TensorFlow base classes that the binding overrides (or
# calls, or sets), by class: each must exist on that class in this TF, checked
# below at import. tests/architecture checks that the binding's classes
# override no private name that is not listed here.
OVERRIDDEN_HOOKS = {
    # distribute/strategy.py: MPIExtended(MirroredExtended)
    MirroredExtended: (
        "_initialize_strategy",  # only the devices: no TF collectives
        "_initialize_single_worker",  # (called) sets up the local devices
        "_num_replicas_in_sync",  # ranks x local devices
        "_get_replica_id_in_sync_group",  # global replica ids
        "_get_local_replica_id",
        "_in_multi_worker_mode",  # the iterator agrees on the end of data
        # `_use_merge_call()`: read by `tf.__internal__.distribute.interim.maybe_merge_call`
        # and `strategy_supports_no_merge_call` (Keras' optimizers and
        # LossScaleOptimizer, tf_keras' optimizers and metrics), by
        # ReplicaContext.all_reduce and by replica-context updates of aggregated
        # variables (values.py). False means "synchronize without merge_call";
        # MPIExtended answers False only where merge_call would fail (below).
        "_use_merge_call",
        # What ReplicaContext.all_reduce and those variable updates call when
        # `_use_merge_call()` is False.
        "_replica_ctx_all_reduce",
        "_get_cross_device_ops",
        "_reduce_to",  # also int32 values and reductions to the host
        "_batch_reduce_to",
        "_gather_to_implementation",
        "_get_variable_creator_initial_value",  # every variable starts as rank 0's
        "_experimental_distribute_dataset",
        "_distribute_datasets_from_function",
        "_experimental_distribute_values_from_function",
        "_input_workers_with_options",  # (called)
        "_container_strategy",  # (called)
    ),
    # distribute/cross_device_ops.py: MPICrossDeviceOps(CrossDeviceOps)
    tf.distribute.CrossDeviceOps: (
        "_num_between_graph_workers",  # 1 would make TF skip the reduction
        "_gather_implementation",
        "_gather",  # (called) by MPIExtended's gather
    ),
    # distribute/sharding.py: SlotPlaceholder(ResourceVariable)
    ResourceVariable: (
        "_serialize_to_tensors",  # recorded in a checkpoint, written by its owner
        "_restore_from_tensors",  # a restore skips it
    ),
}
# Private attributes MPIExtended sets for TensorFlow's and Keras' readers:
# `_communication_options`, `_cross_device_ops`, `_cluster_resolver`,
# `_task_type` / `_task_id` (tf_keras names non-chief scratch directories by
# them), and on MPIStrategy the class attribute `_collective_key_base`.
for _base, _names in OVERRIDDEN_HOOKS.items():
    _missing = [name for name in _names if not hasattr(_base, name)]
    if _missing:  # pragma: no cover - only on an untested TF
        raise MPIStrategyError(
            f"TensorFlow {tf.__version__} has no {_base.__name__}.{', '.join(_missing)}, "
            "which mpi_strategy overrides. Install a TensorFlow between 2.16 and 2.21."
        )


def merge_call_would_fail() -> bool:
    """True where MirroredStrategy's merge_call raises "`merge_call` called while
    defining a new graph": in a replica thread whose current graph is not the one
    its replica function is traced in (inside tf.cond, tf.while_loop or a nested
    tf.function). The same test as mirrored_run._MirroredReplicaContext._merge_call."""
    thread = threading.current_thread()
    replica_thread_class = _mirrored_run._MirroredReplicaThread
    return isinstance(thread, replica_thread_class) and _ops.get_default_graph() is not thread.graph


class Instead(enum.Enum):
    """What a rank that does not write does instead of a listed call
    (``features/saving/calls.py`` holds one handler for each)."""

    MEMORY = "memory"  # the call against an in-memory path (ram://)
    H5_MEMORY = "h5_memory"  # the call against an in-memory HDF5 file
    SKIP = "skip"  # nothing
    SCRATCH_IF_H5 = "scratch_if_h5"  # SCRATCH for an HDF5 file, else MEMORY
    NOOP_WRITER = "noop_writer"  # a writer that writes nothing (and waits in flushes)
    DEVNULL = "devnull"  # the call writing to os.devnull
    SCRATCH = "scratch"  # the call against a fresh local directory, deleted after
    SAME = "same"  # the call unchanged (its own writes are write points)


class WriteCall(NamedTuple):
    """A TensorFlow or Keras function or method that writes files, and how
    ``features/saving`` makes it a write point (see ``features/saving/calls.py``)."""

    owner: str  # "package.module" or "package.module:Class"
    name: str  # function or method name
    path: str  # argument name, or "self.<attribute>"
    instead: Instead  # what a rank that does not write does
    of: str | None  # the argument (or "self.<attribute>") holding the object
    # written, whose strategy decides; None: names no object
    attrs: tuple[str, ...] = ()  # (methods) attributes holding paths under ``path``


# TensorFlow functions that write files, made write points by features/saving
# (one writer per filesystem when every rank calls them). Private ones: the
# Checkpoint._write funnel (write, save, CheckpointManager.save),
# TrackableSaver.save (the variables' files), the checkpoint index and sweep
# helpers, and saved_model's save_and_return_nodes (tf.saved_model.save).
WRITE_CALLS = (
    WriteCall(
        "tensorflow.python.checkpoint.checkpoint:Checkpoint",
        "_write",
        "file_prefix",
        Instead.SAME,
        "self",
    ),
    WriteCall(
        "tensorflow.python.checkpoint.checkpoint:TrackableSaver",
        "save",
        "file_prefix",
        Instead.MEMORY,
        None,
    ),
    # (so that its index and sweep below are inside the write point of its checkpoint)
    WriteCall(
        "tensorflow.python.checkpoint.checkpoint_management:CheckpointManager",
        "save",
        "self.directory",
        Instead.SAME,
        "self.checkpoint",
    ),
    WriteCall(
        "tensorflow.python.checkpoint.checkpoint_management",
        "update_checkpoint_state_internal",
        "save_dir",
        Instead.SKIP,
        None,
    ),
    WriteCall(
        "tensorflow.python.checkpoint.checkpoint_management",
        "_delete_file_if_exists",
        "filespec",
        Instead.SKIP,
        None,
    ),
    WriteCall(
        "tensorflow.python.saved_model.save",
        "save_and_return_nodes",
        "export_dir",
        Instead.MEMORY,
        "obj",
    ),
    WriteCall(
        "tensorflow.python.ops.summary_ops_v2",
        "create_file_writer_v2",
        "logdir",
        Instead.NOOP_WRITER,
        None,
    ),
    WriteCall(
        "tensorflow._api.v2.summary", "create_file_writer", "logdir", Instead.NOOP_WRITER, None
    ),
    WriteCall(
        "tensorflow._api.v2.compat.v2.summary",
        "create_file_writer",
        "logdir",
        Instead.NOOP_WRITER,
        None,
    ),
)
# MirroredStrategy's replica context: what its `_merge_call` returns is the
# one object every replica gets (regrouped into one value, not per replica);
# features/keras_wrappers.py remembers it for an MPIStrategy (effects.py).
MERGE_CALL = (_mirrored_run._MirroredReplicaContext, "_merge_call")
if not hasattr(*MERGE_CALL):  # pragma: no cover - only on an untested TF
    raise MPIStrategyError(
        f"TensorFlow {tf.__version__} has no _MirroredReplicaContext._merge_call, which "
        "mpi_strategy wraps. Install a TensorFlow between 2.16 and 2.21."
    )

# The write call that saves a sharded optimizer's slots in parts, one per rank
# that holds some (features/saving/sharded.py): it sees the object graph.
SAVED_IN_PARTS = ("tensorflow.python.checkpoint.checkpoint:TrackableSaver", "save")

# Checkpoint methods that hand the write to a background thread when
# CheckpointOptions(experimental_enable_async_checkpoint=True): features/saving/calls.py
# makes them write in the calling thread, where the ranks can meet (_write: what
# CheckpointManager.save calls).
ASYNC_CHECKPOINT_CALLS = (
    ("tensorflow.python.checkpoint.checkpoint:Checkpoint", "save"),
    ("tensorflow.python.checkpoint.checkpoint:Checkpoint", "write"),
    ("tensorflow.python.checkpoint.checkpoint:Checkpoint", "_write"),
)

# tf.distribute.experimental.PreemptionCheckpointHandler agrees through TF's
# coordination service; features/preemption overrides these private hooks of
# it (effects.py installs them) to agree through the MPI agreement instead.
PREEMPTION_HANDLER = (
    "tensorflow.python.distribute.failure_handling.failure_handling:PreemptionCheckpointHandler"
)
PREEMPTION_HOOKS = (
    "_initialize_for_mirrored_and_multi_worker_mirrored",  # built as for one worker
    "_maybe_set_received_own_sigterm",  # SIGTERM or termination_watcher_fn: a notice
    "_check_preemption_and_maybe_checkpoint",  # the ranks' common decision
)
# Called or set by those overrides: `_save_checkpoint`, `_stop_poll_termination_signal_thread`,
# `_exit_fn`, `_grace_period`, `_estimated_run_time`, `_run_counter`,
# `_final_checkpoint_countdown`, `_target_time_for_termination`, `_cluster_resolver`.
from tensorflow.python.distribute.failure_handling import failure_handling as _failure_handling  # noqa: E402

_missing_hooks = [
    name
    for name in (*PREEMPTION_HOOKS, "_save_checkpoint", "_stop_poll_termination_signal_thread")
    if not hasattr(_failure_handling.PreemptionCheckpointHandler, name)
]
if _missing_hooks:  # pragma: no cover - only on an untested TF
    raise MPIStrategyError(
        f"TensorFlow {tf.__version__} has no PreemptionCheckpointHandler."
        f"{', '.join(_missing_hooks)}, which mpi_strategy overrides. "
        "Install a TensorFlow between 2.16 and 2.21."
    )
