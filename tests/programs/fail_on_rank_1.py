"""Run by tests/launchers/core/test_failure.py on 2 ranks: ``python fail_on_rank_1.py CASE``.

Trains step after step; rank 1 alone raises, in the place CASE names: inside
the compiled step (``in_step``: a ``tf.debugging.Assert`` in the replica
function), in the input pipeline (``input``: the ``tf.data`` generator) or
between steps (``between``: plain Python). Rank 0 goes on to its next
collective. Shows that the job then ends promptly, with rank 1's traceback
(FIRST_STEP_DONE_AT times the start; ALL_STEPS_DONE must never be printed).
"""

import sys
import time

import numpy as np
import tensorflow as tf

import mpi_strategy

CASE, BAD_STEP = sys.argv[1], 3
strategy = mpi_strategy.MPIStrategy()
rank = strategy.cluster_resolver.task_id


def records():
    for i in range(10**6):
        if CASE == "input" and rank == 1 and i == BAD_STEP * 4:
            raise ValueError(f"corrupt record {i} on rank 1")
        yield np.full([2], i % 7, np.float32)


def dataset_fn(input_context):  # each rank reads its own records
    return tf.data.Dataset.from_generator(
        records, output_signature=tf.TensorSpec([2], tf.float32)
    ).batch(4)


with strategy.scope():
    w = tf.Variable([0.5, -0.5])
    optimizer = tf.keras.optimizers.SGD(0.01)
step = tf.Variable(0, dtype=tf.int64)


@tf.function
def train_step(batch):
    def replica_fn(x):
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        if CASE == "in_step":
            tf.debugging.Assert(
                tf.logical_or(replica != 1, step < BAD_STEP),
                ["loss is not finite on replica", replica],
            )
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.reduce_sum(x * w, axis=1) ** 2)
        optimizer.apply_gradients([(tape.gradient(loss, w), w)])
        return loss

    loss = strategy.run(replica_fn, args=(batch,))
    step.assign_add(1)
    return strategy.reduce("SUM", loss, axis=None)


batches = iter(strategy.distribute_datasets_from_function(dataset_fn))
for i in range(100_000):  # the other rank goes on to its next collectives
    train_step(next(batches))
    if i == 0:
        print(f"FIRST_STEP_DONE_AT={time.time():.3f}", flush=True)
    if CASE == "between" and rank == 1 and i == BAD_STEP:
        raise ValueError("bad batch on rank 1")
print("ALL_STEPS_DONE", flush=True)
