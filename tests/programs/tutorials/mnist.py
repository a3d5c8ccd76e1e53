"""The module mnist.py that tensorflow/docs
site/en/tutorials/distribute/multi_worker_with_ctl.ipynb writes and imports:
its shuffled dataset, its dataset_fn (per-replica batch from the
InputContext, shard by input pipeline, batch) and its L2-regularized CNN, with
the local MNIST of _tutorial.datasets in place of tf.keras.datasets.mnist.
"""

import numpy as np
import tensorflow as tf

from _tutorial import datasets


def mnist_dataset(batch_size):
    (x_train, y_train), _ = datasets.mnist.load_data()
    x_train = x_train / np.float32(255)
    y_train = y_train.astype(np.int64)
    return tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(60000)


def dataset_fn(global_batch_size, input_context):
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    dataset = mnist_dataset(batch_size)
    dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return dataset.batch(batch_size)


def build_cnn_model():
    regularizer = tf.keras.regularizers.L2(1e-5)
    return tf.keras.Sequential(
        [
            tf.keras.Input(shape=(28, 28)),
            tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
            tf.keras.layers.Conv2D(32, 3, activation="relu", kernel_regularizer=regularizer),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(128, activation="relu", kernel_regularizer=regularizer),
            tf.keras.layers.Dense(10, kernel_regularizer=regularizer),
        ]
    )
