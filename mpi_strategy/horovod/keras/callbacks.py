"""``horovod.keras.callbacks``: the callbacks of ``horovod.tensorflow.keras.callbacks``."""

from mpi_strategy.horovod.tensorflow.keras import callbacks as _same
from mpi_strategy.horovod.tensorflow.keras.callbacks import *  # noqa: F403 (one API, two names)

__all__ = list(_same.__all__)
