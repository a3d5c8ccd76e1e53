"""Every private TensorFlow symbol mpi_strategy uses, behind one version check.

TensorFlow's distribute internals move between releases. Keeping each private
import here means a new TF release breaks (at most) this file, loudly, at
import time, instead of somewhere deep inside a training step.
"""

import threading

import tensorflow as tf

from mpi_strategy.errors import MPIStrategyError
from mpi_strategy.logs import logger

SUPPORTED_TF = ((2, 16), (2, 21))  # inclusive range this file was checked against


def _tf_version():
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
        "If something fails in mpi_strategy/_tf_internal.py, TensorFlow's "
        "private distribute API changed.",
        ".".join(map(str, SUPPORTED_TF[1])), tf.__version__)

try:
    # pylint: disable=g-direct-tensorflow-import
    from tensorflow.python.distribute import cross_device_ops as _cross_device_ops
    from tensorflow.python.distribute import distribute_utils as _distribute_utils
    from tensorflow.python.distribute import input_util as _input_util
    from tensorflow.python.distribute import mirrored_run as _mirrored_run
    from tensorflow.python.distribute import mirrored_strategy as _mirrored_strategy
    from tensorflow.python.framework import ops as _ops
    from tensorflow.python.ops import control_flow_util as _control_flow_util
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


def in_xla_context():
    """True when the op being built will be compiled by XLA (jit_compile=True)."""
    return _control_flow_util.GraphOrParentsInXlaContext(_ops.get_default_graph())


def is_mirrored(value):
    return _distribute_utils.is_mirrored(value)


def captured_value(tensor):
    """What a placeholder of a tf.function's graph stands for: a tensor of the
    enclosing graph, or an eager tensor such as a variable's handle; None if
    ``tensor`` is not such a capture. (FuncGraph.captures.)"""
    for external, internal in getattr(tensor.graph, "captures", ()):
        if internal is tensor:
            return external
    return None


# Private hooks of StrategyExtendedV2 / MirroredExtended that MPIExtended
# overrides (strategy.py):
# * `_use_merge_call()`: read by `tf.__internal__.distribute.interim.maybe_merge_call`
#   and `strategy_supports_no_merge_call` (Keras' optimizers and
#   LossScaleOptimizer, tf_keras' optimizers and metrics), by
#   ReplicaContext.all_reduce and by replica-context updates of aggregated
#   variables (values.py). False means "synchronize without merge_call";
#   MPIExtended answers False only where merge_call would fail (below).
# * `_replica_ctx_all_reduce(reduce_op, value, options)`: what
#   ReplicaContext.all_reduce and those variable updates call when
#   `_use_merge_call()` is False.


def merge_call_would_fail():
    """True where MirroredStrategy's merge_call raises "`merge_call` called while
    defining a new graph": in a replica thread whose current graph is not the one
    its replica function is traced in (inside tf.cond, tf.while_loop or a nested
    tf.function). The same test as mirrored_run._MirroredReplicaContext._merge_call."""
    thread = threading.current_thread()
    replica_thread_class = _mirrored_run._MirroredReplicaThread  # pylint: disable=protected-access
    return isinstance(thread, replica_thread_class) and _ops.get_default_graph() is not thread.graph


# TensorFlow functions that write files, made write points by saving.py (one
# writer per filesystem when every rank calls them). Private ones: the
# Checkpoint._write funnel (write, save, CheckpointManager.save),
# TrackableSaver.save (the variables' files), the checkpoint index and sweep
# helpers, and saved_model's save_and_return_nodes (tf.saved_model.save).
WRITE_CALLS = (
    ("tensorflow.python.checkpoint.checkpoint:Checkpoint", "_write", "file_prefix", "same"),
    ("tensorflow.python.checkpoint.checkpoint:TrackableSaver", "save", "file_prefix", "memory"),
    ("tensorflow.python.checkpoint.checkpoint_management", "update_checkpoint_state_internal",
     "save_dir", "skip"),
    ("tensorflow.python.checkpoint.checkpoint_management", "_delete_file_if_exists",
     "filespec", "skip"),
    ("tensorflow.python.saved_model.save", "save_and_return_nodes", "export_dir", "memory"),
    ("tensorflow.python.ops.summary_ops_v2", "create_file_writer_v2", "logdir", "noop_writer"),
    ("tensorflow._api.v2.summary", "create_file_writer", "logdir", "noop_writer"),
    ("tensorflow._api.v2.compat.v2.summary", "create_file_writer", "logdir", "noop_writer"),
)
# Checkpoint methods that hand the write to a background thread when
# CheckpointOptions(experimental_enable_async_checkpoint=True): saving.py makes
# them write in the calling thread, where the ranks can meet (_write: what
# CheckpointManager.save calls).
ASYNC_CHECKPOINT_CALLS = (("tensorflow.python.checkpoint.checkpoint:Checkpoint", "save"),
                          ("tensorflow.python.checkpoint.checkpoint:Checkpoint", "write"),
                          ("tensorflow.python.checkpoint.checkpoint:Checkpoint", "_write"))
