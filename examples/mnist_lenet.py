"""MNIST with LeNet-3 (the seed paper's MNIST workload), trained with Keras fit.

    mpiexec -n 2 python examples/mnist_lenet.py                  # synthetic, no download
    mpiexec -n 4 python examples/mnist_lenet.py --data DIR --epochs 10

LeNet-3: convolutions of 20 and 50 5x5 filters (each followed by 2x2 max
pooling), a fully connected layer of 500, softmax over 10 classes; batch 32
per replica, so the global batch is 32 x strategy.num_replicas_in_sync.

By default it trains on 4,096 synthetic images with MNIST's shape and type
(28x28 uint8, labels 0-9), the same on every rank. With ``--data DIR`` it
reads MNIST's 60,000 training images from the IDX files in DIR
(``train-images-idx3-ubyte`` and ``train-labels-idx1-ubyte``, gzipped or not)
with tf.data, one full pass per epoch. Keras splits every global batch among
the ranks. Rank 0 prints the progress bar and, after each epoch, loss,
accuracy and throughput.
"""

import gzip
import os
import struct

import keras
import numpy as np
import tensorflow as tf

import mpi_strategy
from _common import Throughput, argument_parser

ROWS = COLS = 28
SHUFFLE_BUFFER = 10_000


def synthetic_mnist(n, seed=0):
    """``n`` deterministic uint8 28x28 images and uint8 labels, as in the IDX
    files: each image is a noisy copy of its class's pattern."""
    rng = np.random.default_rng(seed)
    patterns = (rng.random((10, ROWS * COLS)) < 0.2) * 120.0
    labels = rng.integers(0, 10, n)
    images = patterns[labels] + rng.normal(40.0, 70.0, (n, ROWS * COLS))
    # 10% wrong labels: the loss falls but cannot reach zero.
    wrong = rng.random(n) < 0.1
    labels[wrong] = rng.integers(0, 10, wrong.sum())
    return np.clip(images, 0, 255).astype(np.uint8), labels.astype(np.uint8)


def _idx_file(directory, name):
    for candidate in (name, name + ".gz"):
        path = os.path.join(directory, candidate)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"mnist_lenet: no {name} or {name}.gz in {directory}")


def _idx_header(path, magic, dims):
    """The header's item count, after checking its magic number and image size."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        header = f.read(4 * (1 + len(dims) + 1))
    if len(header) < 8 or struct.unpack(">I", header[:4])[0] != magic:
        raise ValueError(f"mnist_lenet: {path} is not an IDX file with magic number {magic:#x}")
    count, *shape = struct.unpack(f">{1 + len(dims)}I", header[4:])
    if tuple(shape) != dims:
        raise ValueError(f"mnist_lenet: {path} holds {shape} images, expected {list(dims)}")
    return count


def read_idx(directory, prefix="train"):
    """(uint8 [784] image, uint8 label) records of ``{prefix}-images-idx3-ubyte``
    and ``{prefix}-labels-idx1-ubyte`` in ``directory``, and their number."""
    images_path = _idx_file(directory, f"{prefix}-images-idx3-ubyte")
    labels_path = _idx_file(directory, f"{prefix}-labels-idx1-ubyte")
    n = _idx_header(images_path, 0x803, (ROWS, COLS))
    n_labels = _idx_header(labels_path, 0x801, ())
    if n != n_labels:
        raise ValueError(f"mnist_lenet: {n} images but {n_labels} labels in {directory}")

    def records(path, record_bytes, header_bytes):
        gz = "GZIP" if path.endswith(".gz") else ""
        return tf.data.FixedLengthRecordDataset(
            path, record_bytes, header_bytes=header_bytes, compression_type=gz
        )

    images = records(images_path, ROWS * COLS, 16).map(lambda r: tf.io.decode_raw(r, tf.uint8))
    labels = records(labels_path, 1, 8).map(lambda r: tf.io.decode_raw(r, tf.uint8)[0])
    return tf.data.Dataset.zip((images, labels)), n


def to_model_input(images, labels):
    """A batch of uint8 records -> float images in [0, 1] and int labels."""
    images = tf.reshape(tf.cast(images, tf.float32) / 255.0, (-1, ROWS, COLS, 1))
    return images, tf.cast(labels, tf.int32)


def lenet3():
    return keras.Sequential(
        [
            keras.Input((ROWS, COLS, 1)),
            keras.layers.Conv2D(20, 5, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(50, 5, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(500, activation="relu"),
            keras.layers.Dense(10),
        ],
        name="lenet3",
    )


def main():
    args = argument_parser(__doc__, epochs=2, batch_per_replica=32, examples=4096).parse_args()
    keras.utils.set_random_seed(1)  # the same shuffling on every rank
    strategy = mpi_strategy.MPIStrategy()
    global_batch = args.batch_per_replica * strategy.num_replicas_in_sync

    if args.data:
        records, n = read_idx(args.data)
    else:
        records = tf.data.Dataset.from_tensor_slices(synthetic_mnist(args.examples))
        n = args.examples
    dataset = (
        records.shuffle(min(n, SHUFFLE_BUFFER), seed=1)
        .batch(global_batch, drop_remainder=True)
        .map(to_model_input, num_parallel_calls=tf.data.AUTOTUNE)
    )
    if args.steps_per_epoch:
        dataset = dataset.repeat()
    options = tf.data.Options()
    # Every rank reads the same global batches and keeps its replicas' share.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = dataset.with_options(options).prefetch(tf.data.AUTOTUNE)

    with strategy.scope():
        model = lenet3()
        model.compile(
            optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    model.fit(
        dataset,
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        callbacks=[Throughput(strategy, global_batch)],
    )


if __name__ == "__main__":
    main()
