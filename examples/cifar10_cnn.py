"""CIFAR-10 with a small CNN (the seed paper's CIFAR-10 workload), trained with Keras fit.

    mpiexec -n 2 python examples/cifar10_cnn.py                  # synthetic, no download
    mpiexec -n 4 python examples/cifar10_cnn.py --data DIR --epochs 20

The network: three convolutions of 32, 32 and 64 5x5 filters (each followed by
2x2 max pooling), a fully connected layer of 64, softmax over 10 classes;
batch 32 per replica, so the global batch is 32 x strategy.num_replicas_in_sync.

By default it trains on 2,048 synthetic images with CIFAR-10's shape and type
(32x32x3 uint8 records, labels 0-9), the same on every rank. With
``--data DIR`` it reads the 50,000 training images of CIFAR-10's binary
version (``data_batch_1.bin`` ... ``data_batch_5.bin`` in DIR or in
DIR/cifar-10-batches-bin) with tf.data, one full pass per epoch. Keras splits
every global batch among the ranks. Rank 0 prints the progress bar and, after
each epoch, loss, accuracy and throughput.
"""

import os

import keras
import numpy as np
import tensorflow as tf

import mpi_strategy
from _common import Throughput, argument_parser

SIZE, CHANNELS = 32, 3
RECORD_BYTES = 1 + SIZE * SIZE * CHANNELS  # a label byte, then R, G and B planes row by row
TRAIN_FILES = [f"data_batch_{i}.bin" for i in range(1, 6)]
SHUFFLE_BUFFER = 10_000


def synthetic_cifar10(n, seed=0):
    """``n`` deterministic records in CIFAR-10's binary layout (uint8 [n, 3073]):
    each image is a noisy copy of its class's coarse colour pattern."""
    rng = np.random.default_rng(seed)
    coarse = rng.random((10, CHANNELS, 8, 8)) * 160.0
    patterns = coarse.repeat(4, axis=2).repeat(4, axis=3).reshape(10, -1)  # 8x8 -> 32x32
    labels = rng.integers(0, 10, n)
    images = patterns[labels] + rng.normal(48.0, 64.0, (n, patterns.shape[1]))
    # 10% wrong labels: the loss falls but cannot reach zero.
    wrong = rng.random(n) < 0.1
    labels[wrong] = rng.integers(0, 10, wrong.sum())
    return np.concatenate([labels[:, None], np.clip(images, 0, 255)], axis=1).astype(np.uint8)


def read_cifar10(directory, files=TRAIN_FILES):
    """The uint8 [3073] records of CIFAR-10 binary batch ``files`` in
    ``directory`` (or its ``cifar-10-batches-bin``), and their number."""
    if not os.path.exists(os.path.join(directory, files[0])):
        directory = os.path.join(directory, "cifar-10-batches-bin")
    paths = [os.path.join(directory, f) for f in files]
    n = 0
    for path in paths:
        if not os.path.exists(path):
            raise FileNotFoundError(f"cifar10_cnn: {path} not found (CIFAR-10 binary version)")
        size = os.path.getsize(path)
        if size == 0 or size % RECORD_BYTES:
            raise ValueError(
                f"cifar10_cnn: {path} has {size} bytes, not a whole number of "
                f"{RECORD_BYTES}-byte CIFAR-10 records"
            )
        n += size // RECORD_BYTES
    records = tf.data.FixedLengthRecordDataset(paths, RECORD_BYTES)
    return records.map(lambda r: tf.io.decode_raw(r, tf.uint8)), n


def to_model_input(records):
    """A batch of uint8 [3073] records -> float HWC images in [0, 1] and int labels."""
    images = tf.reshape(records[:, 1:], (-1, CHANNELS, SIZE, SIZE))
    images = tf.cast(tf.transpose(images, (0, 2, 3, 1)), tf.float32) / 255.0
    return images, tf.cast(records[:, 0], tf.int32)


def cifar10_cnn():
    return keras.Sequential(
        [
            keras.Input((SIZE, SIZE, CHANNELS)),
            keras.layers.Conv2D(32, 5, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(32, 5, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(64, 5, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ],
        name="cifar10_cnn",
    )


def main():
    args = argument_parser(__doc__, epochs=2, batch_per_replica=32, examples=2048).parse_args()
    keras.utils.set_random_seed(1)  # the same shuffling on every rank
    strategy = mpi_strategy.MPIStrategy()
    global_batch = args.batch_per_replica * strategy.num_replicas_in_sync

    if args.data:
        records, n = read_cifar10(args.data)
    else:
        records = tf.data.Dataset.from_tensor_slices(synthetic_cifar10(args.examples))
        n = args.examples
    dataset = (
        records.shuffle(min(n, SHUFFLE_BUFFER), seed=1)
        .batch(global_batch, drop_remainder=True)
        .map(to_model_input, num_parallel_calls=tf.data.AUTOTUNE)
    )
    if args.steps_per_epoch:
        dataset = dataset.repeat()
    options = tf.data.Options()
    # Every rank reads the same global batches and keeps its replicas' share
    # (sharding by file would give ranks unequal shares of the five files).
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = dataset.with_options(options).prefetch(tf.data.AUTOTUNE)

    with strategy.scope():
        model = cifar10_cnn()
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
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
