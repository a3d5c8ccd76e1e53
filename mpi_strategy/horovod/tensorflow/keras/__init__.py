"""``horovod.tensorflow.keras`` on mpi_strategy.

    import mpi_strategy.horovod.tensorflow.keras as hvd  # import horovod.tensorflow.keras as hvd

    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=opt, loss=...)
    model.fit(
        dataset,
        callbacks=[
            hvd.callbacks.BroadcastGlobalVariablesCallback(0),
            hvd.callbacks.MetricAverageCallback(),
        ],
    )

Keras 3 and tf_keras (``TF_USE_LEGACY_KERAS=1``, or tf_keras objects) alike:
``DistributedOptimizer`` averages the gradients over the ranks where every
update of the optimizer passes, and the callbacks are built on the Keras
package of the model they are given. The collectives here take
tensor-compatible values and return tensors (eager), as Horovod's do.
"""

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
from mpi_strategy._src.horovod.compression import Compression
from mpi_strategy._src.horovod.keras import (
    allgather,
    allreduce,
    broadcast,
    broadcast_global_variables,
    load_model,
    reducescatter,
    sync_batch_normalization as _sync_batch_normalization,
)
from mpi_strategy._src.horovod.mpi_ops import Average, Sum
from mpi_strategy._src.horovod.optimizer import DistributedOptimizer, PartialDistributedOptimizer

# (elastic last: it may build on what is above)
from mpi_strategy.horovod.tensorflow.keras import callbacks, elastic

# tf.keras's layer, as Horovod's: tf_keras's under TF_USE_LEGACY_KERAS=1.
SyncBatchNormalization = _sync_batch_normalization()

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "start_timeline",
    "stop_timeline",
    "size",
    "local_size",
    "cross_size",
    "rank",
    "local_rank",
    "cross_rank",
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
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "Average",
    "Sum",
    "Compression",
    "DistributedOptimizer",
    "PartialDistributedOptimizer",
    "SyncBatchNormalization",
    "broadcast_global_variables",
    "allreduce",
    "allgather",
    "broadcast",
    "reducescatter",
    "load_model",
    "callbacks",
    "elastic",
]
