"""Run by tests/launchers/core/test_validation_launched.py on 2 ranks.

Rank r builds MPIStrategy over r + 1 devices (rank 0 one, rank 1 two). Each
rank prints the error it gets; the test shows that both ranks raise, naming
the devices per rank of every rank, instead of training on a lopsided world.
"""

import tensorflow as tf

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
)
from mpi4py import MPI

import mpi_strategy

r = MPI.COMM_WORLD.rank
try:
    mpi_strategy.MPIStrategy(devices=["/cpu:0", "/cpu:1"][: r + 1])
except mpi_strategy.MPIStrategyError as e:
    print("rank", r, "raised:", e, flush=True)
