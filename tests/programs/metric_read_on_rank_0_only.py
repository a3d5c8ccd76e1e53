"""Run by tests/launchers/core/test_timeouts.py on 3 ranks:
``python metric_read_on_rank_0_only.py T``.

MPIStrategy with ``CommunicationOptions(timeout_seconds=T)``: rank 0 reads a
Keras metric (a collective) that ranks 1 and 2 never reach (they sleep).
Shows that rank 0 fails after T seconds, naming the collective and the ranks
that never came, and that the job ends.
"""

import sys
import time

import keras
import tensorflow as tf

import mpi_strategy

timeout = float(sys.argv[1])
strategy = mpi_strategy.MPIStrategy(
    communication_options=tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout)
)
with strategy.scope():
    loss_metric = keras.metrics.Mean()


@tf.function
def step():
    def replica_fn():
        loss_metric.update_state(1.0)
        return tf.constant(1.0)

    return strategy.reduce("SUM", strategy.run(replica_fn), axis=None)


for _ in range(3):
    step()
if strategy.cluster_resolver.task_id == 0:
    print(f"READING at {time.time():.3f}", flush=True)
    print("loss", float(loss_metric.result()))  # a collective: the other ranks never come
else:
    time.sleep(120)  # e.g. busy writing something else; no collective
