"""Follows keras-team/keras-io guides/distributed_training_with_tensorflow.py
("Multi-GPU distributed training with TensorFlow", Keras 3), call for call.

The strategy; in its scope a compiled two-layer MLP (get_compiled_model), the
MNIST datasets (batches of 32; 10,000 examples kept for validation), fit with
validation data and evaluate; then fault tolerance: run_training makes a new
strategy and, in its scope, restores the newest ``.keras`` file of ./ckpt
(by ctime) or makes a new model, and fits with a ModelCheckpoint writing
``ckpt-{epoch}.keras`` each epoch, verbose=2; run twice, the second run
resuming from the first's checkpoint.

Adapted (see _tutorial.py): the strategy lines; local MNIST (400 training
examples, 100 of them kept for validation as the guide keeps 10,000 of 60,000,
and 200 test examples); 1 of the first fit's 2 epochs. Run with the working
directory as argv[1] and as the current directory.
"""

from _tutorial import begin, checksum, datasets, epochs, history, make_strategy, report

begin(keras="keras3")  # the guide is written for Keras 3

import os

os.environ["KERAS_BACKEND"] = "tensorflow"

import keras
import tensorflow as tf

numbers = {}  # (report)


def get_compiled_model():
    inputs = keras.Input(shape=(784,))
    x = keras.layers.Dense(256, activation="relu")(inputs)
    x = keras.layers.Dense(256, activation="relu")(x)
    outputs = keras.layers.Dense(10)(x)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )
    return model


def get_dataset():
    batch_size = 32
    num_val_samples = 100  # (the guide: 10000 of 60000)
    (x_train, y_train), (x_test, y_test) = datasets.mnist.load_data()
    x_train = x_train.reshape(-1, 784).astype("float32") / 255
    x_test = x_test.reshape(-1, 784).astype("float32") / 255
    y_train = y_train.astype("float32")
    y_test = y_test.astype("float32")
    x_val = x_train[-num_val_samples:]
    y_val = y_train[-num_val_samples:]
    x_train = x_train[:-num_val_samples]
    y_train = y_train[:-num_val_samples]
    return (
        tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(batch_size),
        tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(batch_size),
        tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(batch_size),
    )


strategy = make_strategy()
print(f"Number of devices: {strategy.num_replicas_in_sync}")

with strategy.scope():
    model = get_compiled_model()
    train_dataset, val_dataset, test_dataset = get_dataset()
    fit = model.fit(train_dataset, epochs=epochs(2, needed=1), validation_data=val_dataset)
    numbers["fit"] = history(fit)
    numbers["evaluate"] = model.evaluate(test_dataset)
numbers["weights"] = checksum(model.get_weights())

# -- Using callbacks to ensure fault tolerance
checkpoint_dir = "./ckpt"
if not os.path.exists(checkpoint_dir):
    os.makedirs(checkpoint_dir)


def make_or_restore_model():
    checkpoints = [checkpoint_dir + "/" + name for name in os.listdir(checkpoint_dir)]
    if checkpoints:
        latest_checkpoint = max(checkpoints, key=os.path.getctime)
        print("Restoring from", latest_checkpoint)
        restored_from.append(os.path.basename(latest_checkpoint))  # (report)
        return keras.models.load_model(latest_checkpoint)
    print("Creating a new model")
    return get_compiled_model()


restored_from = numbers["restored_from"] = []
runs = numbers["run_training"] = []  # (report) each run's history and weights


def run_training(epochs=1):
    strategy = make_strategy()
    with strategy.scope():
        model = make_or_restore_model()
        runs.append({"weights_at_start": checksum(model.get_weights())})  # (report)
        callbacks = [
            keras.callbacks.ModelCheckpoint(
                filepath=checkpoint_dir + "/ckpt-{epoch}.keras",
                save_freq="epoch",
            )
        ]
        fit = model.fit(
            train_dataset,
            epochs=epochs,
            callbacks=callbacks,
            validation_data=val_dataset,
            verbose=2,
        )
        runs[-1].update(fit=history(fit), weights=checksum(model.get_weights()))  # (report)
        runs[-1].update(checkpoints=sorted(os.listdir(checkpoint_dir)))  # (report)


run_training(epochs=1)
run_training(epochs=1)
report(numbers)
