"""``horovod.tensorflow.keras.callbacks``: Horovod's Keras callbacks (Keras 3 and tf_keras)."""

from mpi_strategy._src.horovod.callbacks import (
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
