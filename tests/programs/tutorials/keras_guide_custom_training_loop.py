"""Follows keras-team/keras-io guides/writing_a_custom_training_loop_in_tensorflow.py
("Writing a training loop from scratch in TensorFlow", Keras 3), call for call.

An MNIST MLP (Functional API), Adam and SparseCategoricalCrossentropy; the
guide's loops: an eager loop of GradientTape steps printing the batch loss;
with SparseCategoricalAccuracy on the training and validation data, reset each
epoch; the same steps in tf.function; a model with an ActivityRegularization
layer whose add_loss is added to the loss (``sum(model.losses)``); and a
DCGAN trained by a tf.function step on all the digits, two optimizers, labels
with uniform noise.

Moved onto tf.distribute as the guide's readers are told to (TensorFlow's
"Custom training with tf.distribute.Strategy"), the same under both strategies:
models, optimizers and metrics made in strategy.scope(); each dataset batched
with the guide's batch size as the global batch and given to
experimental_distribute_dataset; the losses per example
(``reduction=None``) averaged over the global batch by
tf.nn.compute_average_loss (the model's add_loss terms by
scale_regularization_loss); each step run by strategy.run (the eager loop
eagerly, the others in tf.function) and its loss reduced with
strategy.reduce(SUM); the GAN's fake batch per replica is the replica's share
of the guide's ``batch_size``.

Adapted (see _tutorial.py): the strategy line; local MNIST (400 training
examples, of which 100 are kept for validation as the guide keeps 10,000 of
60,000); 1, 1 and 2 of the loops' 3, 2 and 2 epochs; the GAN's convolutions
have 16 filters (the guide: 64 and 128) and it trains 3 steps (the guide: 11),
for CI time; the add_loss step, which the guide only defines, is run for one
epoch with an optimizer of its own (the guide's is built for another model).
Run with the working directory as argv[1] and as the current directory.
"""

from _tutorial import begin, checksum, datasets, epochs, make_strategy, report, steps

begin(keras="keras3")  # the guide is written for Keras 3

import os
import time

os.environ["KERAS_BACKEND"] = "tensorflow"

import keras
import numpy as np
import tensorflow as tf

numbers = {}  # (report)
strategy = make_strategy()


def get_model():
    inputs = keras.Input(shape=(784,), name="digits")
    x1 = keras.layers.Dense(64, activation="relu")(inputs)
    x2 = keras.layers.Dense(64, activation="relu")(x1)
    outputs = keras.layers.Dense(10, name="predictions")(x2)
    model = keras.Model(inputs=inputs, outputs=outputs)
    return model


with strategy.scope():
    model = get_model()
    optimizer = keras.optimizers.Adam(learning_rate=1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def compute_loss(labels, logits, model_losses=()):
    loss = tf.nn.compute_average_loss(loss_fn(labels, logits))
    if model_losses:
        loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
    return loss


batch_size = 32
(x_train, y_train), (x_test, y_test) = datasets.mnist.load_data()
x_train = np.reshape(x_train, (-1, 784))
x_test = np.reshape(x_test, (-1, 784))

num_val_samples = 100  # (the guide: 10000 of 60000)
x_val = x_train[-num_val_samples:]
y_val = y_train[-num_val_samples:]
x_train = x_train[:-num_val_samples]
y_train = y_train[:-num_val_samples]

train_dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train))
train_dataset = train_dataset.shuffle(buffer_size=1024).batch(batch_size)
val_dataset = tf.data.Dataset.from_tensor_slices((x_val, y_val))
val_dataset = val_dataset.batch(batch_size)
train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
val_dist_dataset = strategy.experimental_distribute_dataset(val_dataset)


# -- A first end-to-end example: an eager loop
def eager_step(x_batch_train, y_batch_train):
    with tf.GradientTape() as tape:
        logits = model(x_batch_train, training=True)
        loss_value = compute_loss(y_batch_train, logits)
    grads = tape.gradient(loss_value, model.trainable_weights)
    optimizer.apply(grads, model.trainable_weights)
    return loss_value


printed = numbers["first_loop_printed_losses"] = []
for epoch in range(epochs(3, needed=1)):
    print(f"\nStart of epoch {epoch}")
    for step, (x_batch_train, y_batch_train) in enumerate(train_dist_dataset):
        per_replica = strategy.run(eager_step, args=(x_batch_train, y_batch_train))
        loss_value = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
        if step % 100 == 0:
            print(f"Training loss (for 1 batch) at step {step}: {float(loss_value):.4f}")
            print(f"Seen so far: {(step + 1) * batch_size} samples")
            printed.append(float(loss_value))
numbers["first_loop_weights"] = checksum(model.get_weights())

# -- Low-level handling of metrics: a fresh model, metrics on training and validation data
with strategy.scope():
    model = get_model()
    optimizer = keras.optimizers.Adam(learning_rate=1e-3)
    train_acc_metric = keras.metrics.SparseCategoricalAccuracy()
    val_acc_metric = keras.metrics.SparseCategoricalAccuracy()


def metric_step(x_batch_train, y_batch_train):
    with tf.GradientTape() as tape:
        logits = model(x_batch_train, training=True)
        loss_value = compute_loss(y_batch_train, logits)
    grads = tape.gradient(loss_value, model.trainable_weights)
    optimizer.apply(grads, model.trainable_weights)
    train_acc_metric.update_state(y_batch_train, logits)
    return loss_value


def val_step(x_batch_val, y_batch_val):
    val_logits = model(x_batch_val, training=False)
    val_acc_metric.update_state(y_batch_val, val_logits)


def run_epochs(n, train_step, test_step, key):
    """The guide's epoch loop (written out twice in the guide: eager, then tf.function)."""
    printed = numbers[key] = []
    for epoch in range(n):
        print(f"\nStart of epoch {epoch}")
        start_time = time.time()
        for step, (x_batch_train, y_batch_train) in enumerate(train_dist_dataset):
            loss_value = train_step(x_batch_train, y_batch_train)
            if step % 100 == 0:
                print(f"Training loss (for 1 batch) at step {step}: {float(loss_value):.4f}")
                print(f"Seen so far: {(step + 1) * batch_size} samples")
        train_acc = train_acc_metric.result()
        print(f"Training acc over epoch: {float(train_acc):.4f}")
        train_acc_metric.reset_state()
        for x_batch_val, y_batch_val in val_dist_dataset:
            test_step(x_batch_val, y_batch_val)
        val_acc = val_acc_metric.result()
        val_acc_metric.reset_state()
        print(f"Validation acc: {float(val_acc):.4f}")
        print(f"Time taken: {time.time() - start_time:.2f}s")
        printed.append([float(loss_value), float(train_acc), float(val_acc)])


def eager_metric_step(x, y):
    per_replica = strategy.run(metric_step, args=(x, y))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)


def eager_val_step(x, y):
    strategy.run(val_step, args=(x, y))


run_epochs(epochs(2, needed=1), eager_metric_step, eager_val_step, "metrics_loop")
numbers["metrics_loop_weights"] = checksum(model.get_weights())


# -- Speeding-up the training step with tf.function
@tf.function
def train_step(x, y):
    per_replica = strategy.run(metric_step, args=(x, y))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)


@tf.function
def test_step(x, y):
    strategy.run(val_step, args=(x, y))


run_epochs(epochs(2, needed=2), train_step, test_step, "tf_function_loop")
numbers["tf_function_loop_weights"] = checksum(model.get_weights())


# -- Low-level handling of losses tracked by the model
class ActivityRegularizationLayer(keras.layers.Layer):
    def call(self, inputs):
        self.add_loss(1e-2 * tf.reduce_sum(inputs))
        return inputs


with strategy.scope():
    inputs = keras.Input(shape=(784,), name="digits")
    x = keras.layers.Dense(64, activation="relu")(inputs)
    x = ActivityRegularizationLayer()(x)
    x = keras.layers.Dense(64, activation="relu")(x)
    outputs = keras.layers.Dense(10, name="predictions")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)
    # (not in the guide, which never runs this step: the guide's optimizer is
    # built for the previous model, and Keras 3 refuses a new model's variables)
    optimizer = keras.optimizers.Adam(learning_rate=1e-3)


def add_loss_step(x, y):
    with tf.GradientTape() as tape:
        logits = model(x, training=True)
        loss_value = compute_loss(y, logits, model.losses)
    grads = tape.gradient(loss_value, model.trainable_weights)
    optimizer.apply(grads, model.trainable_weights)
    train_acc_metric.update_state(y, logits)
    return loss_value


@tf.function
def train_step(x, y):
    per_replica = strategy.run(add_loss_step, args=(x, y))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)


# (not in the guide, which only defines this step: one epoch of it)
numbers["add_loss_losses"] = [float(train_step(x, y)) for x, y in train_dist_dataset]
numbers["add_loss_accuracy"] = float(train_acc_metric.result())
numbers["add_loss_weights"] = checksum(model.get_weights())

# -- End-to-end example: a GAN training loop from scratch
FILTERS = 16  # (deviation) the guide's 64 and 128, for CI time
latent_dim = 128
with strategy.scope():
    discriminator = keras.Sequential(
        [
            keras.Input(shape=(28, 28, 1)),
            keras.layers.Conv2D(FILTERS, (3, 3), strides=(2, 2), padding="same"),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.Conv2D(FILTERS, (3, 3), strides=(2, 2), padding="same"),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.GlobalMaxPooling2D(),
            keras.layers.Dense(1),
        ],
        name="discriminator",
    )
    discriminator.summary()
    generator = keras.Sequential(
        [
            keras.Input(shape=(latent_dim,)),
            keras.layers.Dense(7 * 7 * FILTERS),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.Reshape((7, 7, FILTERS)),
            keras.layers.Conv2DTranspose(FILTERS, (4, 4), strides=(2, 2), padding="same"),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.Conv2DTranspose(FILTERS, (4, 4), strides=(2, 2), padding="same"),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.Conv2D(1, (7, 7), padding="same", activation="sigmoid"),
        ],
        name="generator",
    )
    d_optimizer = keras.optimizers.Adam(learning_rate=0.0003)
    g_optimizer = keras.optimizers.Adam(learning_rate=0.0004)
    loss_fn = keras.losses.BinaryCrossentropy(from_logits=True, reduction=None)


# The GAN's noise comes from tf.random.normal / tf.random.uniform with the
# global seed (begin() sets it) and no op seed. MirroredStrategy traces this
# function once per replica, and each replica's ops get their own op seeds:
# the replicas draw different noise. Each MPIStrategy rank traces it once, the
# same graph with the same seeds: every rank draws replica 0's noise (as each
# worker of MultiWorkerMirroredStrategy would). The GAN's numbers differ from
# MirroredStrategy's for that reason: MPIStrategy's difference, not the
# program's (it runs as its guide means under MirroredStrategy).
def gan_step(real_images):
    # the replica's share of the guide's fake batch of `batch_size`
    fakes = batch_size // strategy.num_replicas_in_sync
    random_latent_vectors = tf.random.normal(shape=(fakes, latent_dim))
    generated_images = generator(random_latent_vectors)
    combined_images = tf.concat([generated_images, real_images], axis=0)
    labels = tf.concat([tf.ones((fakes, 1)), tf.zeros((tf.shape(real_images)[0], 1))], axis=0)
    labels += 0.05 * tf.random.uniform(tf.shape(labels))
    with tf.GradientTape() as tape:
        predictions = discriminator(combined_images)
        d_loss = tf.nn.compute_average_loss(loss_fn(labels, predictions))
    grads = tape.gradient(d_loss, discriminator.trainable_weights)
    d_optimizer.apply(grads, discriminator.trainable_weights)

    random_latent_vectors = tf.random.normal(shape=(fakes, latent_dim))
    misleading_labels = tf.zeros((fakes, 1))
    with tf.GradientTape() as tape:
        predictions = discriminator(generator(random_latent_vectors))
        g_loss = tf.nn.compute_average_loss(loss_fn(misleading_labels, predictions))
    grads = tape.gradient(g_loss, generator.trainable_weights)
    g_optimizer.apply(grads, generator.trainable_weights)
    return d_loss, g_loss, generated_images


@tf.function
def train_step(real_images):
    d_loss, g_loss, generated_images = strategy.run(gan_step, args=(real_images,))
    d_loss, g_loss = strategy.reduce(tf.distribute.ReduceOp.SUM, [d_loss, g_loss], axis=None)
    return d_loss, g_loss, strategy.gather(generated_images, axis=0)


batch_size = 64
(x_train, _), (x_test, _) = datasets.mnist.load_data()
all_digits = np.concatenate([x_train, x_test])
all_digits = all_digits.astype("float32") / 255.0
all_digits = np.reshape(all_digits, (-1, 28, 28, 1))
dataset = tf.data.Dataset.from_tensor_slices(all_digits)
dataset = dataset.shuffle(buffer_size=1024).batch(batch_size)
dist_dataset = strategy.experimental_distribute_dataset(dataset)

save_dir = "./"
gan_losses = numbers["gan_losses"] = []
for epoch in range(1):
    print(f"\nStart epoch {epoch}")
    for step, real_images in enumerate(dist_dataset):
        d_loss, g_loss, generated_images = train_step(real_images)
        gan_losses.append([float(d_loss), float(g_loss)])
        if step % 100 == 0:
            print(f"discriminator loss at step {step}: {d_loss:.2f}")
            print(f"adversarial loss at step {step}: {g_loss:.2f}")
            img = keras.utils.array_to_img(generated_images[0] * 255.0, scale=False)
            img.save(os.path.join(save_dir, f"generated_img_{step}.png"))
            numbers[f"generated_img_{step}.png"] = float(
                np.sum(np.asarray(keras.utils.load_img(f"generated_img_{step}.png")))
            )
        if step + 1 >= steps(75):  # (the guide: `if step > 10: break`)
            break

numbers["discriminator_weights"] = checksum(discriminator.get_weights())
numbers["generator_weights"] = checksum(generator.get_weights())
report(numbers)
