"""Run by tests/launchers/features/saving/test_saving_launched.py on 2 ranks:
``python save_at_the_end_of_the_program.py DIR weights|metric``.

Rank 0 alone saves a checkpoint while the other ranks end their program.
Shows that saving weights alone works (it prints SAVED), and that saving a
metric (which needs the other ranks) fails with an error naming the end of
the program instead of hanging.
"""

import os
import sys

import tensorflow as tf
from mpi4py import MPI

import mpi_strategy

strategy = mpi_strategy.MPIStrategy()
with strategy.scope():
    weights = tf.Variable(tf.ones([1000]))
    metric = tf.Variable(
        0.0,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.SUM,
    )
strategy.run(lambda: metric.assign_add(1.0))
if MPI.COMM_WORLD.Get_rank() == 0:  # the others end their program meanwhile
    if sys.argv[2] == "weights":
        tf.train.Checkpoint(w=weights).write(os.path.join(sys.argv[1], "ckpt"))
        print("SAVED", flush=True)
    else:
        tf.train.Checkpoint(m=metric).write(os.path.join(sys.argv[1], "ckpt"))
