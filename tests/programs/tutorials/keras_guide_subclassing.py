"""Follows keras-team/keras-io guides/keras_core/making_new_layers_and_models_via_subclassing.py
("Making new layers and models via subclassing", Keras 3), call for call.

A Linear layer with weights made in __init__ and then in build(); a layer
with a non-trainable weight it adds to on each call (ComputeSum); an MLPBlock
of nested layers; add_loss in an activity regularization layer and in an
outer layer (``layer.losses`` reset on each call), a kernel regularizer's
loss; add_loss in a Functional model fit with and without a compiled loss;
get_config / from_config; a CustomDropout with the ``training`` argument; and
the end-to-end Variational AutoEncoder (Encoder, Decoder and a Sampling layer
drawing keras.random.normal, a KL divergence added with add_loss) fit on
MNIST with MeanSquaredError.

Moved onto tf.distribute as the guide distributed_training_with_tensorflow.py
says, the same under both strategies: every layer and model made in
strategy.scope(), and compile and fit called there too.

Adapted (see _tutorial.py): the strategy line; local MNIST (400 examples:
``x_train.reshape(-1, 784)`` for the guide's ``reshape(60000, 784)``); 1 of the
VAE's 2 epochs; ``keras`` for the guide's ``keras_core`` (its name before
Keras 3); the Sampling layer draws from a SeedGenerator of its own (the
guide's unseeded draw fails under MirroredStrategy too: see there).
Run with the working directory as argv[1] and as the current directory.
"""

from _tutorial import begin, checksum, datasets, epochs, history, make_strategy, report

begin(keras="keras3")  # the guide is written for Keras 3

import keras
import numpy as np
from keras import layers, ops

numbers = {}  # (report)
strategy = make_strategy()


class Linear(keras.layers.Layer):
    def __init__(self, units=32, input_dim=32):
        super().__init__()
        self.w = self.add_weight(
            shape=(input_dim, units),
            initializer="random_normal",
            trainable=True,
        )
        self.b = self.add_weight(shape=(units,), initializer="zeros", trainable=True)

    def call(self, inputs):
        return ops.matmul(inputs, self.w) + self.b


with strategy.scope():
    x = ops.ones((2, 2))
    linear_layer = Linear(4, 2)
    y = linear_layer(x)
    print(y)
    numbers["linear_in_init"] = y
    assert linear_layer.weights == [linear_layer.w, linear_layer.b]


class ComputeSum(keras.layers.Layer):
    def __init__(self, input_dim):
        super().__init__()
        self.total = self.add_weight(initializer="zeros", shape=(input_dim,), trainable=False)

    def call(self, inputs):
        self.total.assign_add(ops.sum(inputs, axis=0))
        return self.total


with strategy.scope():
    x = ops.ones((2, 2))
    my_sum = ComputeSum(2)
    y = my_sum(x)
    print(y.numpy())
    numbers["compute_sum_1"] = y.numpy()
    y = my_sum(x)
    print(y.numpy())
    numbers["compute_sum_2"] = y.numpy()
print("weights:", len(my_sum.weights))
print("non-trainable weights:", len(my_sum.non_trainable_weights))
print("trainable_weights:", my_sum.trainable_weights)
numbers["compute_sum_counts"] = [
    len(my_sum.weights),
    len(my_sum.non_trainable_weights),
    len(my_sum.trainable_weights),
]


class Linear(keras.layers.Layer):
    def __init__(self, units=32):
        super().__init__()
        self.units = units

    def build(self, input_shape):
        self.w = self.add_weight(
            shape=(input_shape[-1], self.units),
            initializer="random_normal",
            trainable=True,
        )
        self.b = self.add_weight(shape=(self.units,), initializer="random_normal", trainable=True)

    def call(self, inputs):
        return ops.matmul(inputs, self.w) + self.b


with strategy.scope():
    linear_layer = Linear(32)
    y = linear_layer(x)
    numbers["linear_in_build"] = checksum([y])


class MLPBlock(keras.layers.Layer):
    def __init__(self):
        super().__init__()
        self.linear_1 = Linear(32)
        self.linear_2 = Linear(32)
        self.linear_3 = Linear(1)

    def call(self, inputs):
        x = self.linear_1(inputs)
        x = keras.activations.relu(x)
        x = self.linear_2(x)
        x = keras.activations.relu(x)
        return self.linear_3(x)


with strategy.scope():
    mlp = MLPBlock()
    y = mlp(ops.ones(shape=(3, 64)))
print("weights:", len(mlp.weights))
print("trainable weights:", len(mlp.trainable_weights))
numbers["mlp"] = [y, len(mlp.weights), len(mlp.trainable_weights)]


class ActivityRegularizationLayer(keras.layers.Layer):
    def __init__(self, rate=1e-2):
        super().__init__()
        self.rate = rate

    def call(self, inputs):
        self.add_loss(self.rate * ops.mean(inputs))
        return inputs


class OuterLayer(keras.layers.Layer):
    def __init__(self):
        super().__init__()
        self.activity_reg = ActivityRegularizationLayer(1e-2)

    def call(self, inputs):
        return self.activity_reg(inputs)


with strategy.scope():
    layer = OuterLayer()
    assert len(layer.losses) == 0
    _ = layer(ops.zeros((1, 1)))
    assert len(layer.losses) == 1
    _ = layer(ops.zeros((1, 1)))
    assert len(layer.losses) == 1


class OuterLayerWithKernelRegularizer(keras.layers.Layer):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(32, kernel_regularizer=keras.regularizers.l2(1e-3))

    def call(self, inputs):
        return self.dense(inputs)


with strategy.scope():
    layer = OuterLayerWithKernelRegularizer()
    _ = layer(ops.zeros((1, 1)))
print(layer.losses)
numbers["kernel_regularizer_losses"] = layer.losses

with strategy.scope():
    inputs = keras.Input(shape=(3,))
    outputs = ActivityRegularizationLayer()(inputs)
    model = keras.Model(inputs, outputs)

    model.compile(optimizer="adam", loss="mse")
    fit = model.fit(np.random.random((2, 3)), np.random.random((2, 3)))
    numbers["add_loss_with_compiled_loss_fit"] = history(fit)

    model.compile(optimizer="adam")
    fit = model.fit(np.random.random((2, 3)), np.random.random((2, 3)))
    numbers["add_loss_only_fit"] = history(fit)


class Linear(keras.layers.Layer):
    def __init__(self, units=32, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.w = self.add_weight(
            shape=(input_shape[-1], self.units),
            initializer="random_normal",
            trainable=True,
        )
        self.b = self.add_weight(shape=(self.units,), initializer="random_normal", trainable=True)

    def call(self, inputs):
        return ops.matmul(inputs, self.w) + self.b

    def get_config(self):
        config = super().get_config()
        config.update({"units": self.units})
        return config


with strategy.scope():
    layer = Linear(64)
    config = layer.get_config()
    print(config)
    new_layer = Linear.from_config(config)
numbers["config_units"] = [config["units"], new_layer.units]


class CustomDropout(keras.layers.Layer):
    def __init__(self, rate, **kwargs):
        super().__init__(**kwargs)
        self.rate = rate

    def call(self, inputs, training=None):
        if training:
            return keras.random.dropout(inputs, rate=self.rate)
        return inputs


# -- Putting it all together: a Variational AutoEncoder
# (not in the guide) The guide's unseeded keras.random.normal draws from
# Keras' global SeedGenerator, whose variable it creates on first use: under
# any tf.distribute strategy, MirroredStrategy too, fit builds the model
# symbolically first and then traces the step, which creates it again: "tf.function
# only supports singleton tf.Variables created on the first call". The layer
# keeps a SeedGenerator of its own instead, as Keras' error for JAX advises.
class Sampling(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = ops.shape(z_mean)[0]
        dim = ops.shape(z_mean)[1]
        epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


class Encoder(layers.Layer):
    def __init__(self, latent_dim=32, intermediate_dim=64, name="encoder", **kwargs):
        super().__init__(name=name, **kwargs)
        self.dense_proj = layers.Dense(intermediate_dim, activation="relu")
        self.dense_mean = layers.Dense(latent_dim)
        self.dense_log_var = layers.Dense(latent_dim)
        self.sampling = Sampling()

    def call(self, inputs):
        x = self.dense_proj(inputs)
        z_mean = self.dense_mean(x)
        z_log_var = self.dense_log_var(x)
        z = self.sampling((z_mean, z_log_var))
        return z_mean, z_log_var, z


class Decoder(layers.Layer):
    def __init__(self, original_dim, intermediate_dim=64, name="decoder", **kwargs):
        super().__init__(name=name, **kwargs)
        self.dense_proj = layers.Dense(intermediate_dim, activation="relu")
        self.dense_output = layers.Dense(original_dim, activation="sigmoid")

    def call(self, inputs):
        x = self.dense_proj(inputs)
        return self.dense_output(x)


class VariationalAutoEncoder(keras.Model):
    def __init__(
        self, original_dim, intermediate_dim=64, latent_dim=32, name="autoencoder", **kwargs
    ):
        super().__init__(name=name, **kwargs)
        self.original_dim = original_dim
        self.encoder = Encoder(latent_dim=latent_dim, intermediate_dim=intermediate_dim)
        self.decoder = Decoder(original_dim, intermediate_dim=intermediate_dim)

    def call(self, inputs):
        z_mean, z_log_var, z = self.encoder(inputs)
        reconstructed = self.decoder(z)
        kl_loss = -0.5 * ops.mean(z_log_var - ops.square(z_mean) - ops.exp(z_log_var) + 1)
        self.add_loss(kl_loss)
        return reconstructed


(x_train, _), _ = datasets.mnist.load_data()
x_train = x_train.reshape(-1, 784).astype("float32") / 255

with strategy.scope():
    original_dim = 784
    vae = VariationalAutoEncoder(784, 64, 32)
    optimizer = keras.optimizers.Adam(learning_rate=1e-3)
    vae.compile(optimizer, loss=keras.losses.MeanSquaredError())
    fit = vae.fit(x_train, x_train, epochs=epochs(2, needed=1), batch_size=64)
numbers["vae_fit"] = history(fit)
numbers["vae_weights"] = checksum(vae.get_weights())
report(numbers)
