"""A Horovod program, run unchanged on mpi_strategy (no Horovod installed).

    mpiexec -n 2 python -m mpi_strategy.horovod examples/horovod_custom_loop.py

It is written for Horovod (``import horovod.tensorflow as hvd``), as its
users write it: each rank reads its shard of the data, DistributedGradientTape
averages the gradients, rank 0's initial weights are broadcast after the
first step, and rank 0 prints the loss and the held-out accuracy after each
epoch. ``python -m mpi_strategy.horovod`` resolves ``horovod`` to
``mpi_strategy.horovod``; or change the import to
``import mpi_strategy.horovod.tensorflow as hvd``. The data: the handwritten
digits in examples/data (no download).
"""

import argparse
import gzip
import os

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

DIGITS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "digits.csv.gz")


def load_digits():
    """The same 80/20 split on every rank: (x_train, y_train), (x_test, y_test)."""
    with gzip.open(DIGITS) as f:
        table = np.loadtxt(f, delimiter=",")
    images, labels = (table[:, :-1] / 16).astype(np.float32), table[:, -1].astype(np.int64)
    order = np.random.default_rng(0).permutation(len(labels))
    return (images[order[:-360]], labels[order[:-360]]), (
        images[order[-360:]],
        labels[order[-360:]],
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    args = parser.parse_args()

    hvd.init()
    (x_train, y_train), (x_test, y_test) = load_digits()
    data = (
        tf.data.Dataset.from_tensor_slices((x_train, y_train))
        .shard(hvd.size(), hvd.rank())
        .shuffle(2000, seed=1)
        .batch(args.batch_size)
    )
    model = tf.keras.Sequential(
        [tf.keras.Input((64,)), tf.keras.layers.Dense(64, "relu"), tf.keras.layers.Dense(10)]
    )
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # Horovod's rule: scale the learning rate by the number of ranks.
    optimizer = tf.keras.optimizers.Adam(0.001 * hvd.size())

    @tf.function
    def train_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:  # every rank starts from rank 0's weights and optimizer state
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(optimizer.variables, root_rank=0)
        return hvd.allreduce(loss)

    first = True
    for epoch in range(1, args.epochs + 1):
        losses = []
        for images, labels in data:
            losses.append(float(train_step(images, labels, tf.constant(first))))
            first = False
        logits = model(x_test, training=False)
        accuracy = float(np.mean(np.argmax(logits, axis=1) == y_test))
        if hvd.rank() == 0:
            print(
                f"epoch {epoch}/{args.epochs}: loss {np.mean(losses):.4f}  "
                f"test accuracy {accuracy:.4f}  ({hvd.size()} ranks)",
                flush=True,
            )


if __name__ == "__main__":
    main()
