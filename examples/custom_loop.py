"""Data-parallel training with a custom loop: the template to copy.

    mpiexec -n 2 python examples/custom_loop.py

A small network learns the handwritten digits shipped in examples/data/ (1797
8x8 images, no download); after each epoch rank 0 prints the training loss and
accuracy and the accuracy on held-out test images. Everything below is plain
tf.distribute code; the only MPI-specific line is ``MPIStrategy()``.
"""

import argparse
import gzip
import os
import time

import numpy as np
import tensorflow as tf

from mpi_strategy import MPIStrategy

DIGITS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "digits.csv.gz")


def load_digits():
    """The same 80/20 train/test split on every rank: (x_train, y_train), (x_test, y_test)."""
    with gzip.open(DIGITS) as f:
        table = np.loadtxt(f, delimiter=",")  # 64 pixels (0-16), then the label
    images, labels = (table[:, :-1] / 16).astype(np.float32), table[:, -1].astype(np.int64)
    order = np.random.default_rng(0).permutation(len(labels))
    train, test = order[:-360], order[-360:]
    return (images[train], labels[train]), (images[test], labels[test])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-per-replica", type=int, default=32)
    parser.add_argument(
        "--examples",
        type=int,
        default=None,
        help="train on at most this many images (default: all 1437)",
    )
    args = parser.parse_args()

    strategy = MPIStrategy()
    chief = strategy.cluster_resolver.task_id == 0
    global_batch = args.batch_per_replica * strategy.num_replicas_in_sync
    if chief:
        print(f"{strategy.num_replicas_in_sync} replicas, global batch {global_batch}")

    (x_train, y_train), (x_test, y_test) = load_digits()
    x_train, y_train = x_train[: args.examples], y_train[: args.examples]
    train_dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x_train, y_train))
        .shuffle(len(x_train), seed=1)
        .batch(global_batch, drop_remainder=True)
    )
    test_dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(global_batch)
    )

    tf.keras.utils.set_random_seed(0)  # the same run every time
    with strategy.scope():
        model = tf.keras.Sequential(
            [
                tf.keras.Input((64,)),
                tf.keras.layers.Dense(128, activation="relu"),
                tf.keras.layers.Dense(10),
            ]
        )
        optimizer = tf.keras.optimizers.Adam(3e-3)
        train_accuracy = tf.keras.metrics.SparseCategoricalAccuracy()
        test_accuracy = tf.keras.metrics.SparseCategoricalAccuracy()
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def replica_train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.nn.compute_average_loss(loss_fn(y, logits), global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        train_accuracy.update_state(y, logits)
        return loss

    def replica_test_step(x, y):
        test_accuracy.update_state(y, model(x, training=False))

    @tf.function
    def train_step(batch):
        return strategy.reduce("SUM", strategy.run(replica_train_step, args=batch), axis=None)

    @tf.function
    def test_step(batch):
        strategy.run(replica_test_step, args=batch)

    for epoch in range(args.epochs):
        start, total, steps = time.perf_counter(), 0.0, 0
        for batch in train_dataset:
            total += float(train_step(batch))
            steps += 1
        seconds = time.perf_counter() - start
        for batch in test_dataset:
            test_step(batch)
        # Reading a metric is a collective: every rank reads it, rank 0 prints.
        train_acc, test_acc = float(train_accuracy.result()), float(test_accuracy.result())
        train_accuracy.reset_state()
        test_accuracy.reset_state()
        if chief:
            print(
                f"epoch {epoch + 1}/{args.epochs}: loss {total / steps:.4f}  "
                f"accuracy {train_acc:.4f}  test accuracy {test_acc:.4f}  "
                f"{steps * global_batch / seconds:,.0f} examples/s",
                flush=True,
            )


if __name__ == "__main__":
    main()
