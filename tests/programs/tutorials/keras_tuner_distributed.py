"""Follows keras-team/keras-io guides/keras_tuner/distributed_tuning.py
("Distributed hyperparameter tuning", its example code for data parallelism
with ``tf.distribute``), call for call.

``build_model(hp)``: a CNN of 1-3 Conv2D blocks (filters, kernel size, max or
average pooling, BatchNormalization, ReLU), global max or average pooling and
a softmax Dense, compiled with the chosen optimizer; a
``keras_tuner.Hyperband(max_epochs=2, factor=3, hyperband_iterations=1)`` with
``distribution_strategy=<the strategy>``, ``directory="results_dir"``,
``overwrite=True``; MNIST reshaped to a channel axis and scaled, the first
1000 training and 100 test examples; ``tuner.search`` with
``steps_per_epoch``, validation data, ``validation_steps`` and an
``EarlyStopping("val_accuracy")`` callback. Then what its users read after a
search: the trials and their scores, the best hyperparameters, the best model
(loaded from the trial's checkpoint) and its evaluation.

Adapted (see _tutorial.py): the strategy line (``distribution_strategy=``);
local MNIST (400 and 200 examples, so all of them are taken); 25 of the 600
steps per epoch and 5 of the 100 validation steps. (Given arrays and steps,
Keras 3 makes the batch size ``ceil(examples / steps)``: the guide's 1000/600
and 100/100 give batches of 2 and 1, 400/24 and 100/4 would give 17 and 25.
Keras 3.15's ``fit`` and ``evaluate`` under a strategy first reduce the first
batch's shards with MEAN (``_maybe_symbolic_build`` in
keras/src/backend/tensorflow/trainer.py), which fails when a batch does not
split evenly over the replicas: the guide's validation batch of 1, and 17 and
25, fail under MirroredStrategy too. 25 and 5 steps give batches of 16 and 20.) The
``KERASTUNER_*`` variables of distributed tuning are not set (one tuner, as
the guide's code runs without them). ``AveragePooling2D`` is given
``pool_size=2``, Keras 2's default: the guide's call without it raises
TypeError in Keras 3.15, under MirroredStrategy and in one process too.
``overwrite=False`` (the directory is new here): with ``overwrite=True`` every
rank removes ``results_dir/mnist`` if it exists when that rank looks, so a
rank that looks after another has created it removes the other's files
(NotFoundError there; CI saw it twice in a row). One process never races with
itself; mpi_strategy does not make ``exists`` then ``rmtree`` one step
(docs/troubleshooting.md).
Run with the working directory as argv[1] and as the current directory.
"""

from _tutorial import begin, checksum, datasets, make_strategy, report

begin(keras="keras3")

import keras_tuner
import numpy as np
import tensorflow as tf


def build_model(hp):
    """Builds a convolutional model."""
    inputs = tf.keras.Input(shape=(28, 28, 1))
    x = inputs
    for i in range(hp.Int("conv_layers", 1, 3, default=3)):
        x = tf.keras.layers.Conv2D(
            filters=hp.Int("filters_" + str(i), 4, 32, step=4, default=8),
            kernel_size=hp.Int("kernel_size_" + str(i), 3, 5),
            activation="relu",
            padding="same",
        )(x)

        if hp.Choice("pooling" + str(i), ["max", "avg"]) == "max":
            x = tf.keras.layers.MaxPooling2D()(x)
        else:
            # (pool_size: Keras 3.15 requires it, under MirroredStrategy and in one process
            # too; 2 is Keras 2's default, which the guide's code relied on)
            x = tf.keras.layers.AveragePooling2D(pool_size=2)(x)

        x = tf.keras.layers.BatchNormalization()(x)
        x = tf.keras.layers.ReLU()(x)

    if hp.Choice("global_pooling", ["max", "avg"]) == "max":
        x = tf.keras.layers.GlobalMaxPooling2D()(x)
    else:
        x = tf.keras.layers.GlobalAveragePooling2D()(x)
    outputs = tf.keras.layers.Dense(10, activation="softmax")(x)

    model = tf.keras.Model(inputs, outputs)

    optimizer = hp.Choice("optimizer", ["adam", "sgd"])
    model.compile(optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


tuner = keras_tuner.Hyperband(
    hypermodel=build_model,
    objective="val_accuracy",
    max_epochs=2,
    factor=3,
    hyperband_iterations=1,
    distribution_strategy=make_strategy(),
    directory="results_dir",
    project_name="mnist",
    overwrite=False,  # (see the module's docstring)
)

(x_train, y_train), (x_test, y_test) = datasets.mnist.load_data()

# Reshape the images to have the channel dimension.
x_train = (x_train.reshape((*x_train.shape, 1)) / 255.0)[:1000]
y_train = y_train.astype(np.int64)[:1000]
x_test = (x_test.reshape((*x_test.shape, 1)) / 255.0)[:100]
y_test = y_test.astype(np.int64)[:100]

tuner.search(
    x_train,
    y_train,
    steps_per_epoch=25,  # (of 600: see the docstring)
    validation_data=(x_test, y_test),
    validation_steps=5,  # (of 100)
    callbacks=[tf.keras.callbacks.EarlyStopping("val_accuracy")],
)

# -- What a user reads after the search
trials = [
    [trial.trial_id, trial.status, trial.score, trial.hyperparameters.values]
    for trial in tuner.oracle.trials.values()
]
best_hyperparameters = tuner.get_best_hyperparameters()[0].values
print(best_hyperparameters)
best_model = tuner.get_best_models()[0]
evaluated = best_model.evaluate(x_test, y_test)
print(evaluated)

# (The first Conv2D's bias feeds a BatchNormalization, which subtracts the batch
# mean again: its gradient is zero but for float rounding, and Adam divides it by
# its own running scale, so the bias moves by rounding noise. That bias and the
# moving mean after it (best_model_weights[1] and [4]) are the weights to differ
# from MirroredStrategy's beyond rounding, if any do: 0.3% at 2 ranks, where the
# others agree to 1e-6.)
report(
    {
        "trials": trials,
        "best_hyperparameters": best_hyperparameters,
        "best_model_evaluate": evaluated,
        "best_model_weights": checksum(best_model.get_weights()),
    }
)
