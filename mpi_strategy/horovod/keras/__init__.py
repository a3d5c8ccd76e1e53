"""``horovod.keras`` (Horovod's API for standalone Keras) on mpi_strategy:
``import mpi_strategy.horovod.keras as hvd``.

The same objects as ``mpi_strategy.horovod.tensorflow.keras`` (standalone
Keras is Keras 3 here, which the objects there serve), with ``Adasum`` among
the op constants as in Horovod (``DistributedOptimizer`` refuses it).
``callbacks`` and ``elastic`` are those modules too (``horovod.keras.callbacks``
imports the same objects).
"""

from mpi_strategy._src.horovod.mpi_ops import Adasum
from mpi_strategy.horovod.tensorflow import keras as _tensorflow_keras
from mpi_strategy.horovod.tensorflow.keras import *  # noqa: F403 (one API, two names)

__all__ = [*_tensorflow_keras.__all__, "Adasum"]
