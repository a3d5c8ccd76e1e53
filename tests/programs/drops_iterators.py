"""Run by tests/launchers/distribute/test_dropped_iterators.py: reads one batch
from a fresh iterator of a distributed dataset and drops it, many times.

    python tests/programs/drops_iterators.py mpi|mirrored ITERATIONS

The pipeline is the one Keras 3 builds from arrays (a parallel map and an
autotuned prefetch, TensorFlow's default optimizations off). TensorFlow's own
multi-device iterator can then crash (SIGSEGV) when dropped: its prefetch thread
outlives the per-device iterator whose context it runs with
(mpi_strategy/_src/distribute/datasets.py). Prints ``REPORT {"survived": N}`` at the end.
"""

import json
import sys

import numpy as np
import tensorflow as tf

kind, iterations = sys.argv[1], int(sys.argv[2])
if kind == "mpi":
    from mpi_strategy import MPIStrategy

    strategy = MPIStrategy()
else:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])

batch = 8 * strategy.num_replicas_in_sync
BATCHES = 50  # (the prefetch thread is still busy when an iterator is dropped)
rows = np.arange(BATCHES * batch * 4, dtype=np.float32).reshape(BATCHES * batch, 4)
options = tf.data.Options()
options.experimental_optimization.apply_default_optimizations = False
dataset = (
    tf.data.Dataset.range(BATCHES)
    .map(
        lambda i: tf.gather(rows, tf.range(batch) + tf.cast(i, tf.int32) * batch),
        num_parallel_calls=tf.data.AUTOTUNE,
    )
    .with_options(options)
    .prefetch(tf.data.AUTOTUNE)
)
distributed = strategy.experimental_distribute_dataset(dataset)


@tf.function
def step(iterator):
    return strategy.run(tf.reduce_sum, args=(next(iterator),))


for done in range(1, iterations + 1):
    iterator = iter(distributed)
    step(iterator)
    del iterator
    if done % 50 == 0:
        print("dropped", done, flush=True)  # (the launcher's sign of life)
print("REPORT " + json.dumps({"survived": iterations}), flush=True)
