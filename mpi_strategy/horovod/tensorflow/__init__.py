"""``horovod.tensorflow`` on mpi_strategy: ``import mpi_strategy.horovod.tensorflow as hvd``.

Every collective is one ordered op of the process set's communicator: eager
or inside ``tf.function``, every rank gets the same result, and ranks that
disagree (shape, dtype, op, root, order) raise ``MismatchError`` (a
``tf.errors.FailedPreconditionError``) on every rank instead of hanging.
Collectives are matched by program order, not by name.
"""

import inspect as _inspect

import tensorflow as _tf

from mpi_strategy._src.horovod.api import (
    allreduce,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from mpi_strategy._src.horovod.basics import (
    ProcessSet,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from mpi_strategy._src.horovod.exceptions import MismatchError, StalledError
from mpi_strategy._src.horovod.functions import (
    allgather_object,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from mpi_strategy._src.horovod.gradients import (
    DistributedGradientTape,
    PartialDistributedGradientTape,
)
from mpi_strategy._src.horovod.keras import sync_batch_normalization as _sync_batch_normalization
from mpi_strategy._src.horovod.mpi_ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    grouped_allgather,
    handle_average_backwards_compatibility,
    join,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    size_op,
)
from mpi_strategy._src.horovod.optimizer import (
    tensorflow_distributed_optimizer as DistributedOptimizer,
)
from mpi_strategy.horovod.tensorflow import elastic, util
from mpi_strategy.horovod.tensorflow.compression import Compression
from mpi_strategy.horovod.tensorflow.util import _executing_eagerly

# tf.keras's layer, as Horovod's: tf_keras's under TF_USE_LEGACY_KERAS=1.
SyncBatchNormalization = _sync_batch_normalization()

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "is_homogeneous",
    "rank_op",
    "size_op",
    "local_rank_op",
    "local_size_op",
    "process_set_included_op",
    "mpi_threads_supported",
    "mpi_enabled",
    "mpi_built",
    "gloo_enabled",
    "gloo_built",
    "nccl_built",
    "ddl_built",
    "ccl_built",
    "cuda_built",
    "rocm_built",
    "start_timeline",
    "stop_timeline",
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "allreduce",
    "grouped_allreduce",
    "allgather",
    "grouped_allgather",
    "broadcast",
    "broadcast_",
    "alltoall",
    "reducescatter",
    "grouped_reducescatter",
    "join",
    "barrier",
    "broadcast_variables",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_object_fn",
    "allgather_object",
    "Compression",
    "DistributedGradientTape",
    "PartialDistributedGradientTape",
    "DistributedOptimizer",
    "SyncBatchNormalization",
    "MismatchError",
    "StalledError",
    "handle_average_backwards_compatibility",
    "elastic",
    "util",
    "_executing_eagerly",
]

# Called inside tf.function, these run as written: AutoGraph would otherwise
# try (and warn) to convert the library's Python and mpi4py's methods.
for _name in __all__:
    if _inspect.isfunction(globals()[_name]):
        globals()[_name] = _tf.autograph.experimental.do_not_convert(globals()[_name])
