"""Follows keras-team/keras-io guides/transfer_learning.py
("Transfer learning & fine-tuning", Keras 3), call for call.

The ``trainable`` API: the weights, trainable and non-trainable weights of a
Dense and a BatchNormalization layer, a frozen Dense layer; a two-layer model
with its first layer frozen, fit on two random examples, its frozen weights
checked unchanged; ``trainable`` set recursively on a nested model. Then the
end-to-end example: cats vs. dogs images of various sizes resized to 150x150,
cache/batch/prefetch, RandomFlip and RandomRotation augmentation, a frozen base
model called with ``training=False`` under a Rescaling layer, pooling, Dropout
and a Dense head, fit with validation data; then the base unfrozen, the model
recompiled with a low learning rate and fit again.

Moved onto tf.distribute as the guide distributed_training_with_tensorflow.py
says, the same under both strategies: every model built and compiled in
strategy.scope(), fit called there too.

Adapted (see _tutorial.py): the strategy line. Xception's ImageNet weights
cannot be downloaded here: the base model is a small convolutional network
with BatchNormalization (what the guide's notes on BatchNormalization are
about) built locally with random weights, ``include_top=False``-like (a 4-D
output). TFDS's cats_vs_dogs is stood in for by 96 synthetic uint8 RGB images
of various sizes with 0/1 labels, split 64/16/16 as the guide splits 40%, 10%
and 10%. 2 of the fits' 20 and 10 epochs. The matplotlib figures are left out
(no display). Run with the working directory as argv[1] and as the current
directory.
"""

from _tutorial import SEED, begin, checksum, epochs, history, make_strategy, report

begin(keras="keras3")  # the guide is written for Keras 3

import re
import types

import keras
import numpy as np
import tensorflow as tf

numbers = {}  # (report)
strategy = make_strategy()


def _cats_vs_dogs(split, as_supervised):
    """Like ``tfds.load("cats_vs_dogs", split=[...], as_supervised=True)``: for each
    ``train[a%:b%]`` split, a dataset of (uint8 image (h, w, 3), int64 label) of
    various sizes, with a known cardinality as TFDS gives."""
    assert as_supervised
    total = 160  # "train[:40%]" is 64 of them
    rng = np.random.default_rng(SEED)
    images, labels = [], []
    for _ in range(total):
        label = int(rng.integers(0, 2))
        h, w = (int(s) for s in rng.integers(60, 200, 2))
        base = np.linspace(0, 255, w)[None, :, None] if label else np.full((1, w, 1), 128.0)
        noise = rng.normal(0, 40, (h, w, 3))
        images.append(np.clip(base + noise, 0, 255).astype(np.uint8))
        labels.append(label)
    datasets = []
    for s in split:
        lo, hi = (int(p or 0) for p in re.fullmatch(r"train\[(\d*)%?:(\d*)%\]", s).groups())
        chosen = range(total * lo // 100, total * hi // 100)
        dataset = tf.data.Dataset.from_generator(
            lambda chosen=chosen: ((images[i], labels[i]) for i in chosen),
            output_signature=(
                tf.TensorSpec((None, None, 3), tf.uint8),
                tf.TensorSpec((), tf.int64),
            ),
        )
        datasets.append(dataset.apply(tf.data.experimental.assert_cardinality(len(chosen))))
    return datasets


tfds = types.SimpleNamespace(  # (local data) stands in for tensorflow_datasets
    load=lambda name, split, as_supervised: _cats_vs_dogs(split, as_supervised),
    disable_progress_bar=lambda: None,
)

# -- Freezing layers: understanding the `trainable` attribute
counts = numbers["weight_counts"] = []  # (report) what the guide prints


def print_counts(layer):
    print("weights:", len(layer.weights))
    print("trainable_weights:", len(layer.trainable_weights))
    print("non_trainable_weights:", len(layer.non_trainable_weights))
    counts.append(
        [len(layer.weights), len(layer.trainable_weights), len(layer.non_trainable_weights)]
    )


with strategy.scope():
    layer = keras.layers.Dense(3)
    layer.build((None, 4))
    print_counts(layer)

    layer = keras.layers.BatchNormalization()
    layer.build((None, 4))
    print_counts(layer)

    layer = keras.layers.Dense(3)
    layer.build((None, 4))
    layer.trainable = False
    print_counts(layer)

    layer1 = keras.layers.Dense(3, activation="relu")
    layer2 = keras.layers.Dense(3, activation="sigmoid")
    model = keras.Sequential([keras.Input(shape=(3,)), layer1, layer2])
    layer1.trainable = False
    initial_layer1_weights_values = layer1.get_weights()
    model.compile(optimizer="adam", loss="mse")
    fit = model.fit(np.random.random((2, 3)), np.random.random((2, 3)))
    final_layer1_weights_values = layer1.get_weights()
np.testing.assert_allclose(initial_layer1_weights_values[0], final_layer1_weights_values[0])
np.testing.assert_allclose(initial_layer1_weights_values[1], final_layer1_weights_values[1])
numbers["frozen_layer_fit"] = history(fit)
numbers["frozen_layer_model_weights"] = checksum(model.get_weights())

# -- Recursive setting of the `trainable` attribute
with strategy.scope():
    inner_model = keras.Sequential(
        [
            keras.Input(shape=(3,)),
            keras.layers.Dense(3, activation="relu"),
            keras.layers.Dense(3, activation="relu"),
        ]
    )
    model = keras.Sequential(
        [
            keras.Input(shape=(3,)),
            inner_model,
            keras.layers.Dense(3, activation="sigmoid"),
        ]
    )
model.trainable = False
assert inner_model.trainable == False  # noqa: E712 - the guide's check
assert inner_model.layers[0].trainable == False  # noqa: E712

# -- An end-to-end example: the data
tfds.disable_progress_bar()
train_ds, validation_ds, test_ds = tfds.load(
    "cats_vs_dogs",
    split=["train[:40%]", "train[40%:50%]", "train[50%:60%]"],
    as_supervised=True,
)
numbers["samples"] = [
    int(tf.data.experimental.cardinality(d)) for d in (train_ds, validation_ds, test_ds)
]
print("Number of training samples: %d" % numbers["samples"][0])
print("Number of validation samples: %d" % numbers["samples"][1])
print("Number of test samples: %d" % numbers["samples"][2])

size = (150, 150)
train_ds = train_ds.map(lambda x, y: (tf.image.resize(x, size), y))
validation_ds = validation_ds.map(lambda x, y: (tf.image.resize(x, size), y))
test_ds = test_ds.map(lambda x, y: (tf.image.resize(x, size), y))

batch_size = 32
train_ds = train_ds.cache().batch(batch_size).prefetch(buffer_size=10)
validation_ds = validation_ds.cache().batch(batch_size).prefetch(buffer_size=10)
test_ds = test_ds.cache().batch(batch_size).prefetch(buffer_size=10)

from keras import layers

with strategy.scope():
    data_augmentation = keras.Sequential(
        [layers.RandomFlip("horizontal"), layers.RandomRotation(0.1)]
    )

    # -- Build a model (the base: a local stand-in for Xception without its top)
    base_model = keras.Sequential(
        [
            keras.Input(shape=(150, 150, 3)),
            layers.Conv2D(8, 3, strides=2),
            layers.BatchNormalization(),
            layers.ReLU(),
            layers.Conv2D(16, 3, strides=2),
            layers.BatchNormalization(),
            layers.ReLU(),
        ],
        name="base_model",
    )
    base_model.trainable = False

    inputs = keras.Input(shape=(150, 150, 3))
    x = data_augmentation(inputs)
    scale_layer = keras.layers.Rescaling(scale=1 / 127.5, offset=-1)
    x = scale_layer(x)
    x = base_model(x, training=False)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dropout(0.2)(x)
    outputs = keras.layers.Dense(1)(x)
    model = keras.Model(inputs, outputs)
    model.summary()
base_before = checksum(base_model.get_weights())

# -- Train the top layer
with strategy.scope():
    model.compile(
        optimizer=keras.optimizers.Adam(),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[keras.metrics.BinaryAccuracy()],
    )
    fit = model.fit(train_ds, epochs=epochs(20, needed=2), validation_data=validation_ds)
numbers["top_fit"] = history(fit)
numbers["top_weights"] = checksum(model.get_weights())
numbers["base_unchanged_by_top_fit"] = checksum(base_model.get_weights()) == base_before

# -- A round of fine-tuning of the entire model
base_model.trainable = True
model.summary()
with strategy.scope():
    model.compile(
        optimizer=keras.optimizers.Adam(1e-5),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[keras.metrics.BinaryAccuracy()],
    )
    fit = model.fit(train_ds, epochs=epochs(10, needed=2), validation_data=validation_ds)
numbers["fine_tuning_fit"] = history(fit)
numbers["fine_tuned_weights"] = checksum(model.get_weights())
report(numbers)
