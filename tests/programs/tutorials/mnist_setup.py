"""The module mnist_setup.py that tensorflow/docs
site/en/tutorials/distribute/multi_worker_with_keras.ipynb writes and imports:
its dataset (shuffled, repeated, batched) and its compiled CNN, with the local
MNIST of _tutorial.datasets in place of tf.keras.datasets.mnist.
"""

import numpy as np
import tensorflow as tf

from _tutorial import datasets


def mnist_dataset(batch_size):
    (x_train, y_train), _ = datasets.mnist.load_data()
    x_train = x_train / np.float32(255)
    y_train = y_train.astype(np.int64)
    return (
        tf.data.Dataset.from_tensor_slices((x_train, y_train))
        .shuffle(60000)
        .repeat()
        .batch(batch_size)
    )


def build_and_compile_cnn_model():
    model = tf.keras.Sequential(
        [
            tf.keras.layers.InputLayer(input_shape=(28, 28)),
            tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
            tf.keras.layers.Conv2D(32, 3, activation="relu"),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(128, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )
    model.compile(
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.SGD(learning_rate=0.001),
        metrics=["accuracy"],
    )
    return model
