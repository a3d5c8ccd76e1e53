"""``horovod.keras.elastic``: ``mpi_strategy.horovod.tensorflow.keras.elastic``'s objects."""

from mpi_strategy.horovod.tensorflow.keras import elastic as _same
from mpi_strategy.horovod.tensorflow.keras.elastic import *  # noqa: F403 (one API, two names)

__all__ = list(_same.__all__)
