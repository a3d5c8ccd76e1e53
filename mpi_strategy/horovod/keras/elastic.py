"""``horovod.keras.elastic``: ``mpi_strategy.horovod.tensorflow.keras.elastic``'s objects."""

from mpi_strategy.horovod.tensorflow.keras.elastic import (
    CommitStateCallback,
    KerasState,
    TensorFlowKerasState,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
    run,
)

__all__ = [
    "KerasState",
    "TensorFlowKerasState",
    "CommitStateCallback",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
]
