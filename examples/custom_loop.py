"""Data-parallel training with a custom loop: the template to copy.

    mpiexec -n 2 python examples/custom_loop.py

Runs on synthetic MNIST-shaped data (no download). Everything below is plain
tf.distribute code; the only MPI-specific line is ``MPIStrategy()``.
"""

import argparse
import time

import numpy as np
import tensorflow as tf

from mpi_strategy import MPIStrategy


def synthetic_mnist(n, seed=0):
    """Deterministic 28x28 "digits": each class is a noisy copy of a class template."""
    rng = np.random.default_rng(seed)
    templates = rng.random((10, 784)).astype(np.float32)
    labels = rng.integers(0, 10, n)
    images = templates[labels] + 0.3 * rng.standard_normal((n, 784)).astype(np.float32)
    return images, labels.astype(np.int64)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-per-replica", type=int, default=64)
    parser.add_argument("--examples", type=int, default=8192)
    args = parser.parse_args()

    strategy = MPIStrategy()
    chief = strategy.cluster_resolver.task_id == 0
    global_batch = args.batch_per_replica * strategy.num_replicas_in_sync
    if chief:
        print(f"{strategy.num_replicas_in_sync} replicas, global batch {global_batch}")

    images, labels = synthetic_mnist(args.examples)
    dataset = tf.data.Dataset.from_tensor_slices((images, labels)).shuffle(
        args.examples, seed=1).batch(global_batch)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)

    with strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.Input((784,)),
            tf.keras.layers.Dense(256, activation="relu"),
            tf.keras.layers.Dense(10),
        ])
        optimizer = tf.keras.optimizers.Adam(1e-3)
        accuracy = tf.keras.metrics.SparseCategoricalAccuracy()
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.nn.compute_average_loss(loss_fn(y, logits), global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        accuracy.update_state(y, logits)
        return loss

    @tf.function
    def train_step(batch):
        return strategy.reduce("SUM", strategy.run(replica_step, args=batch), axis=None)

    for epoch in range(args.epochs):
        start, total, steps = time.perf_counter(), 0.0, 0
        for batch in dist_dataset:
            total += float(train_step(batch))
            steps += 1
        seconds = time.perf_counter() - start
        acc = float(accuracy.result())  # a collective: every rank reads it
        accuracy.reset_state()
        if chief:
            print(f"epoch {epoch + 1}: loss {total / steps:.4f}  accuracy {acc:.4f}  "
                  f"{args.examples / seconds:,.0f} samples/s "
                  f"({args.examples / seconds / strategy.cluster_resolver.num_workers:,.0f} per rank)")


if __name__ == "__main__":
    main()
