"""Follows keras-team/keras-io guides/custom_train_step_in_tensorflow.py
("Customizing what happens in `fit()` with TensorFlow", Keras 3), call for call.

A Model subclass whose train_step computes the loss with compute_loss and
updates self.metrics, fit on NumPy arrays; a lower-level one with its own Mean
and MeanAbsoluteError metrics listed in its ``metrics`` property and only an
optimizer compiled; one that unpacks sample_weight (fit with
``sample_weight``); one with its own test_step (evaluate); and a GAN whose
train_step trains a discriminator and a generator, with its own compile and
keras.random draws from a SeedGenerator, fit on the digits.

Moved onto tf.distribute as the guide distributed_training_with_tensorflow.py
says, the same under both strategies: each model built and compiled in
strategy.scope(), fit and evaluate called there too.

Adapted (see _tutorial.py): the strategy line; local MNIST for the GAN; 1 of
the fits' 3, 5 and 3 epochs; the GAN's convolutions have 16 filters (the
guide: 64 and 128), and it trains on 4 of the guide's 100 batches, for CI
time. The GAN is marked built before its fit (``gan.built = True``): without
it, its fit fails under MirroredStrategy too (see there).
Run with the working directory as argv[1] and as the current directory.
"""

from _tutorial import begin, checksum, datasets, epochs, history, make_strategy, report, steps

begin(keras="keras3")  # the guide is written for Keras 3

import os

os.environ["KERAS_BACKEND"] = "tensorflow"

import keras
import numpy as np
import tensorflow as tf
from keras import layers

numbers = {}  # (report)
strategy = make_strategy()


# -- A first simple example
class CustomModel(keras.Model):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


with strategy.scope():
    inputs = keras.Input(shape=(32,))
    outputs = keras.layers.Dense(1)(inputs)
    model = CustomModel(inputs, outputs)
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])

    x = np.random.random((1000, 32))
    y = np.random.random((1000, 1))
    numbers["first_fit"] = history(model.fit(x, y, epochs=epochs(3, needed=1)))
numbers["first_weights"] = checksum(model.get_weights())


# -- Going lower-level
class CustomModel(keras.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {
            "loss": self.loss_tracker.result(),
            "mae": self.mae_metric.result(),
        }

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


with strategy.scope():
    inputs = keras.Input(shape=(32,))
    outputs = keras.layers.Dense(1)(inputs)
    model = CustomModel(inputs, outputs)
    model.compile(optimizer="adam")

    x = np.random.random((1000, 32))
    y = np.random.random((1000, 1))
    numbers["lower_level_fit"] = history(model.fit(x, y, epochs=epochs(5, needed=1)))
numbers["lower_level_weights"] = checksum(model.get_weights())


# -- Supporting sample_weight & class_weight
class CustomModel(keras.Model):
    def train_step(self, data):
        if len(data) == 3:
            x, y, sample_weight = data
        else:
            sample_weight = None
            x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred, sample_weight=sample_weight)
        return {m.name: m.result() for m in self.metrics}


with strategy.scope():
    inputs = keras.Input(shape=(32,))
    outputs = keras.layers.Dense(1)(inputs)
    model = CustomModel(inputs, outputs)
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])

    x = np.random.random((1000, 32))
    y = np.random.random((1000, 1))
    sw = np.random.random((1000, 1))
    fit = model.fit(x, y, sample_weight=sw, epochs=epochs(3, needed=1))
    numbers["sample_weight_fit"] = history(fit)
numbers["sample_weight_weights"] = checksum(model.get_weights())


# -- Providing your own evaluation step
class CustomModel(keras.Model):
    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


with strategy.scope():
    inputs = keras.Input(shape=(32,))
    outputs = keras.layers.Dense(1)(inputs)
    model = CustomModel(inputs, outputs)
    model.compile(loss="mse", metrics=["mae"])

    x = np.random.random((1000, 32))
    y = np.random.random((1000, 1))
    numbers["custom_test_step_evaluate"] = model.evaluate(x, y)

# -- Wrapping up: an end-to-end GAN example
FILTERS = 16  # (deviation) the guide's 64 and 128, for CI time
with strategy.scope():
    discriminator = keras.Sequential(
        [
            keras.Input(shape=(28, 28, 1)),
            layers.Conv2D(FILTERS, (3, 3), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(FILTERS, (3, 3), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.GlobalMaxPooling2D(),
            layers.Dense(1),
        ],
        name="discriminator",
    )
    latent_dim = 128
    generator = keras.Sequential(
        [
            keras.Input(shape=(latent_dim,)),
            layers.Dense(7 * 7 * FILTERS),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Reshape((7, 7, FILTERS)),
            layers.Conv2DTranspose(FILTERS, (4, 4), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2DTranspose(FILTERS, (4, 4), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(1, (7, 7), padding="same", activation="sigmoid"),
        ],
        name="generator",
    )


class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.seed_generator = keras.random.SeedGenerator(1337)

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real_images):
        if isinstance(real_images, tuple):
            real_images = real_images[0]
        batch_size = tf.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        generated_images = self.generator(random_latent_vectors)
        combined_images = tf.concat([generated_images, real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * keras.random.uniform(tf.shape(labels), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply(grads, self.discriminator.trainable_weights)

        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        misleading_labels = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply(grads, self.generator.trainable_weights)

        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {
            "d_loss": self.d_loss_tracker.result(),
            "g_loss": self.g_loss_tracker.result(),
        }


batch_size = 64
(x_train, _), (x_test, _) = datasets.mnist.load_data()
all_digits = np.concatenate([x_train, x_test])
all_digits = all_digits.astype("float32") / 255.0
all_digits = np.reshape(all_digits, (-1, 28, 28, 1))
dataset = tf.data.Dataset.from_tensor_slices(all_digits)
dataset = dataset.shuffle(buffer_size=1024).batch(batch_size)

with strategy.scope():
    gan = GAN(discriminator=discriminator, generator=generator, latent_dim=latent_dim)
    gan.compile(
        d_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
        g_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    # (not in the guide) Under any tf.distribute strategy, MirroredStrategy
    # too, Keras 3.15's fit first builds the model by calling it on a symbolic
    # batch, and the guide's GAN has no call(): "Unable to automatically build
    # the model". Its sub-models are built (each starts with an Input): it is.
    gan.built = True
    numbers["gan_fit"] = history(gan.fit(dataset.take(steps(100)), epochs=1))
numbers["gan_weights"] = checksum(gan.get_weights())
report(numbers)
