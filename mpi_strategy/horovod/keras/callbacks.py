"""``horovod.keras.callbacks``: the callbacks of ``horovod.tensorflow.keras.callbacks``."""

from mpi_strategy.horovod.tensorflow.keras.callbacks import (
    BestModelCheckpoint,
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "MetricAverageCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "BestModelCheckpoint",
]
