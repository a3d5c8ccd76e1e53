"""Follows keras-team/keras-io guides/keras_core/training_with_built_in_methods.py
("Training & evaluation with the built-in methods", Keras 3), call for call.

An MNIST MLP fit on NumPy arrays with validation data, evaluate, predict;
compile with objects and with strings; a custom loss function and a Loss
subclass (CustomMSE) on one-hot labels; a Metric subclass
(CategoricalTruePositives); add_loss from an activity regularization layer; a
LogisticEndpoint layer whose add_loss is the only loss (compile without a
loss, fit on a dict); validation_split; tf.data datasets for fit, evaluate
(metrics_names), steps_per_epoch and validation_data; a PyDataset;
class_weight, sample_weight on arrays and
in a dataset; a two-input two-output model compiled with lists and dicts of
losses and metrics, loss_weights and outputs without a loss, fit on lists
and a dataset of dicts; EarlyStopping on val_loss; ModelCheckpoint with
save_best_only and ``{epoch}`` in the name; make_or_restore_model with a
ModelCheckpoint every few batches (``{loss:.2f}`` in the name); an
ExponentialDecay schedule; the TensorBoard callback constructed.

Moved onto tf.distribute as the guide distributed_training_with_tensorflow.py
says, the same under both strategies: every model built and compiled in
strategy.scope(), fit, evaluate and predict called there too.

Adapted (see _tutorial.py): the strategy line; local MNIST (400 training
examples, 100 of them kept for validation as the guide keeps 10,000 of 60,000,
and 200 test examples); 4 of the EarlyStopping fit's 20 epochs (enough for its
patience of 2), 1 of the other fits' 1 to 3 epochs; steps_per_epoch and
the checkpoint's save_freq cut by steps() (100, 100 -> 4, 4: the local data
has 5 batches); make_or_restore_model called once
more at the end, to restore what the checkpoints wrote; the LogisticEndpoint
model is fit on 4 examples, not 3 (with 3, its fit fails under
MirroredStrategy too: see there). Left out: the PyTorch
DataLoader section (PyTorch is not installed; the guide imports it only for
that), plot_model (needs pydot and graphviz), and for CI time three fits
that repeat another with one change (validation_steps, a PyDataset with
workers=4, the two-input model on dicts). Run with the working directory
as argv[1] and as the current directory.
"""

from _tutorial import begin, checksum, datasets, epochs, history, make_strategy, report, steps

begin(keras="keras3")  # the guide is written for Keras 3

import os

import keras
import numpy as np
import tensorflow as tf
from keras import layers, ops

numbers = {}  # (report)
strategy = make_strategy()

# -- API overview: a first end-to-end example
with strategy.scope():
    inputs = keras.Input(shape=(784,), name="digits")
    x = layers.Dense(64, activation="relu", name="dense_1")(inputs)
    x = layers.Dense(64, activation="relu", name="dense_2")(x)
    outputs = layers.Dense(10, activation="softmax", name="predictions")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)

(x_train, y_train), (x_test, y_test) = datasets.mnist.load_data()
x_train = x_train.reshape(-1, 784).astype("float32") / 255
x_test = x_test.reshape(-1, 784).astype("float32") / 255
y_train = y_train.astype("float32")
y_test = y_test.astype("float32")

num_val_samples = 100  # (the guide: 10000 of 60000)
x_val = x_train[-num_val_samples:]
y_val = y_train[-num_val_samples:]
x_train = x_train[:-num_val_samples]
y_train = y_train[:-num_val_samples]

with strategy.scope():
    model.compile(
        optimizer=keras.optimizers.RMSprop(),
        loss=keras.losses.SparseCategoricalCrossentropy(),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )
    print("Fit model on training data")
    history_ = model.fit(
        x_train, y_train, batch_size=64, epochs=epochs(2, needed=1), validation_data=(x_val, y_val)
    )
    numbers["first_fit"] = history(history_)
    print("Evaluate on test data")
    results = model.evaluate(x_test, y_test, batch_size=128)
    print("test loss, test acc:", results)
    numbers["first_evaluate"] = results
    print("Generate predictions for 3 samples")
    predictions = model.predict(x_test[:3])
    print("predictions shape:", predictions.shape)
    numbers["first_predictions"] = predictions

    model.compile(
        optimizer=keras.optimizers.RMSprop(learning_rate=1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )
    model.compile(
        optimizer="rmsprop",
        loss="sparse_categorical_crossentropy",
        metrics=["sparse_categorical_accuracy"],
    )


def get_uncompiled_model():
    inputs = keras.Input(shape=(784,), name="digits")
    x = layers.Dense(64, activation="relu", name="dense_1")(inputs)
    x = layers.Dense(64, activation="relu", name="dense_2")(x)
    outputs = layers.Dense(10, activation="softmax", name="predictions")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)
    return model


def get_compiled_model():
    model = get_uncompiled_model()
    model.compile(
        optimizer="rmsprop",
        loss="sparse_categorical_crossentropy",
        metrics=["sparse_categorical_accuracy"],
    )
    return model


def fit(key, model, *args, **kwargs):
    """(report) ``model.fit(*args, **kwargs)``; its history and the weights kept as ``key``."""
    numbers[key] = history(model.fit(*args, **kwargs))
    numbers[key + "_weights"] = checksum(model.get_weights())


# -- Custom losses
def custom_mean_squared_error(y_true, y_pred):
    return ops.mean(ops.square(y_true - y_pred), axis=-1)


with strategy.scope():
    model = get_uncompiled_model()
    model.compile(optimizer=keras.optimizers.Adam(), loss=custom_mean_squared_error)
    y_train_one_hot = ops.one_hot(y_train, num_classes=10)
    fit("loss_function", model, x_train, y_train_one_hot, batch_size=64, epochs=1)


class CustomMSE(keras.losses.Loss):
    def __init__(self, regularization_factor=0.1, name="custom_mse"):
        super().__init__(name=name)
        self.regularization_factor = regularization_factor

    def call(self, y_true, y_pred):
        mse = ops.mean(ops.square(y_true - y_pred), axis=-1)
        reg = ops.mean(ops.square(0.5 - y_pred), axis=-1)
        return mse + reg * self.regularization_factor


with strategy.scope():
    model = get_uncompiled_model()
    model.compile(optimizer=keras.optimizers.Adam(), loss=CustomMSE())
    y_train_one_hot = ops.one_hot(y_train, num_classes=10)
    fit("loss_subclass", model, x_train, y_train_one_hot, batch_size=64, epochs=1)


# -- Custom metrics
class CategoricalTruePositives(keras.metrics.Metric):
    def __init__(self, name="categorical_true_positives", **kwargs):
        super().__init__(name=name, **kwargs)
        self.true_positives = self.add_variable(shape=(), name="ctp", initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_pred = ops.reshape(ops.argmax(y_pred, axis=1), (-1, 1))
        values = ops.cast(y_true, "int32") == ops.cast(y_pred, "int32")
        values = ops.cast(values, "float32")
        if sample_weight is not None:
            sample_weight = ops.cast(sample_weight, "float32")
            values = ops.multiply(values, sample_weight)
        self.true_positives.assign_add(ops.sum(values))

    def result(self):
        return self.true_positives

    def reset_state(self):
        self.true_positives.assign(0.0)


with strategy.scope():
    model = get_uncompiled_model()
    model.compile(
        optimizer=keras.optimizers.RMSprop(learning_rate=1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(),
        metrics=[CategoricalTruePositives()],
    )
    fit("custom_metric", model, x_train, y_train, batch_size=64, epochs=epochs(3, needed=1))


# -- Losses and metrics that don't fit the standard signature
class ActivityRegularizationLayer(layers.Layer):
    def call(self, inputs):
        self.add_loss(ops.sum(inputs) * 0.1)
        return inputs


with strategy.scope():
    inputs = keras.Input(shape=(784,), name="digits")
    x = layers.Dense(64, activation="relu", name="dense_1")(inputs)
    x = ActivityRegularizationLayer()(x)
    x = layers.Dense(64, activation="relu", name="dense_2")(x)
    outputs = layers.Dense(10, name="predictions")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(
        optimizer=keras.optimizers.RMSprop(learning_rate=1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    fit("add_loss", model, x_train, y_train, batch_size=64, epochs=1)


class LogisticEndpoint(keras.layers.Layer):
    def __init__(self, name=None):
        super().__init__(name=name)
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def call(self, targets, logits, sample_weights=None):
        loss = self.loss_fn(targets, logits, sample_weights)
        self.add_loss(loss)
        return ops.softmax(logits)


with strategy.scope():
    inputs = keras.Input(shape=(3,), name="inputs")
    targets = keras.Input(shape=(10,), name="targets")
    logits = keras.layers.Dense(10)(inputs)
    predictions = LogisticEndpoint(name="predictions")(targets, logits)
    model = keras.Model(inputs=[inputs, targets], outputs=predictions)
    model.compile(optimizer="adam")
    # (deviation) 4 examples, not 3: under any tf.distribute strategy,
    # MirroredStrategy too, Keras 3.15's fit first reduces the replicas' parts
    # of the first batch with MEAN (to build the model), which fails when
    # they differ in size (2 and 1: "Inputs to operation AddN ... must have
    # the same size and shape").
    data = {
        "inputs": np.random.random((4, 3)),
        "targets": np.random.random((4, 10)),
    }
    fit("logistic_endpoint", model, data)

# -- Automatically setting apart a validation holdout set
with strategy.scope():
    model = get_compiled_model()
    fit("validation_split", model, x_train, y_train, batch_size=64, validation_split=0.2, epochs=1)

# -- Training & evaluation using tf.data Datasets
with strategy.scope():
    model = get_compiled_model()
    train_dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    train_dataset = train_dataset.shuffle(buffer_size=1024).batch(64)
    test_dataset = tf.data.Dataset.from_tensor_slices((x_test, y_test))
    test_dataset = test_dataset.batch(64)
    fit("dataset", model, train_dataset, epochs=epochs(3, needed=1))
    print("Evaluate")
    result = model.evaluate(test_dataset)
    numbers["dataset_evaluate"] = dict(zip(model.metrics_names, result))

    model = get_compiled_model()
    train_dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    train_dataset = train_dataset.shuffle(buffer_size=1024).batch(64)
    fit(
        "steps_per_epoch",
        model,
        train_dataset,
        epochs=epochs(3, needed=1),
        steps_per_epoch=steps(100),
    )

    model = get_compiled_model()
    train_dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    train_dataset = train_dataset.shuffle(buffer_size=1024).batch(64)
    val_dataset = tf.data.Dataset.from_tensor_slices((x_val, y_val))
    val_dataset = val_dataset.batch(64)
    fit("validation_dataset", model, train_dataset, epochs=1, validation_data=val_dataset)

    # (the guide's fit with validation_steps left out: CI time; run_all.DEVIATIONS)


# -- Training & evaluation using PyDataset instances
class ExamplePyDataset(keras.utils.PyDataset):
    def __init__(self, x, y, batch_size, **kwargs):
        super().__init__(**kwargs)
        self.x = x
        self.y = y
        self.batch_size = batch_size

    def __len__(self):
        return int(np.ceil(len(self.x) / float(self.batch_size)))

    def __getitem__(self, idx):
        batch_x = self.x[idx * self.batch_size : (idx + 1) * self.batch_size]
        batch_y = self.y[idx * self.batch_size : (idx + 1) * self.batch_size]
        return batch_x, batch_y


train_py_dataset = ExamplePyDataset(x_train, y_train, batch_size=32)
val_py_dataset = ExamplePyDataset(x_val, y_val, batch_size=32)
with strategy.scope():
    model = get_compiled_model()
    fit(
        "py_dataset",
        model,
        train_py_dataset,
        batch_size=64,
        validation_data=val_py_dataset,
        epochs=1,
    )
    numbers["py_dataset_evaluate"] = model.evaluate(val_py_dataset)

# (the guide's PyDataset with workers=4 left out: CI time; run_all.DEVIATIONS)

# -- Using sample weighting and class weighting
class_weight = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 2.0, 6: 1.0, 7: 1.0, 8: 1.0, 9: 1.0}
print("Fit with class weight")
with strategy.scope():
    model = get_compiled_model()
    fit("class_weight", model, x_train, y_train, class_weight=class_weight, batch_size=64, epochs=1)

sample_weight = np.ones(shape=(len(y_train),))
sample_weight[y_train == 5] = 2.0
print("Fit with sample weight")
with strategy.scope():
    model = get_compiled_model()
    fit(
        "sample_weight",
        model,
        x_train,
        y_train,
        sample_weight=sample_weight,
        batch_size=64,
        epochs=1,
    )

sample_weight = np.ones(shape=(len(y_train),))
sample_weight[y_train == 5] = 2.0
train_dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train, sample_weight))
train_dataset = train_dataset.shuffle(buffer_size=1024).batch(64)
with strategy.scope():
    model = get_compiled_model()
    fit("sample_weight_dataset", model, train_dataset, epochs=1)

# -- Passing data to multi-input, multi-output models
with strategy.scope():
    image_input = keras.Input(shape=(32, 32, 3), name="img_input")
    timeseries_input = keras.Input(shape=(None, 10), name="ts_input")
    x1 = layers.Conv2D(3, 3)(image_input)
    x1 = layers.GlobalMaxPooling2D()(x1)
    x2 = layers.Conv1D(3, 3)(timeseries_input)
    x2 = layers.GlobalMaxPooling1D()(x2)
    x = layers.concatenate([x1, x2])
    score_output = layers.Dense(1, name="score_output")(x)
    class_output = layers.Dense(5, name="class_output")(x)
    model = keras.Model(
        inputs=[image_input, timeseries_input], outputs=[score_output, class_output]
    )

    model.compile(
        optimizer=keras.optimizers.RMSprop(1e-3),
        loss=[keras.losses.MeanSquaredError(), keras.losses.CategoricalCrossentropy()],
    )
    model.compile(
        optimizer=keras.optimizers.RMSprop(1e-3),
        loss=[keras.losses.MeanSquaredError(), keras.losses.CategoricalCrossentropy()],
        metrics=[
            [keras.metrics.MeanAbsolutePercentageError(), keras.metrics.MeanAbsoluteError()],
            [keras.metrics.CategoricalAccuracy()],
        ],
    )
    model.compile(
        optimizer=keras.optimizers.RMSprop(1e-3),
        loss={
            "score_output": keras.losses.MeanSquaredError(),
            "class_output": keras.losses.CategoricalCrossentropy(),
        },
        metrics={
            "score_output": [
                keras.metrics.MeanAbsolutePercentageError(),
                keras.metrics.MeanAbsoluteError(),
            ],
            "class_output": [keras.metrics.CategoricalAccuracy()],
        },
    )
    model.compile(
        optimizer=keras.optimizers.RMSprop(1e-3),
        loss={
            "score_output": keras.losses.MeanSquaredError(),
            "class_output": keras.losses.CategoricalCrossentropy(),
        },
        metrics={
            "score_output": [
                keras.metrics.MeanAbsolutePercentageError(),
                keras.metrics.MeanAbsoluteError(),
            ],
            "class_output": [keras.metrics.CategoricalAccuracy()],
        },
        loss_weights={"score_output": 2.0, "class_output": 1.0},
    )
    model.compile(
        optimizer=keras.optimizers.RMSprop(1e-3),
        loss=[None, keras.losses.CategoricalCrossentropy()],
    )
    model.compile(
        optimizer=keras.optimizers.RMSprop(1e-3),
        loss={"class_output": keras.losses.CategoricalCrossentropy()},
    )
    model.compile(
        optimizer=keras.optimizers.RMSprop(1e-3),
        loss=[keras.losses.MeanSquaredError(), keras.losses.CategoricalCrossentropy()],
    )

    img_data = np.random.random_sample(size=(100, 32, 32, 3))
    ts_data = np.random.random_sample(size=(100, 20, 10))
    score_targets = np.random.random_sample(size=(100, 1))
    class_targets = np.random.random_sample(size=(100, 5))
    fit(
        "multi_io_lists",
        model,
        [img_data, ts_data],
        [score_targets, class_targets],
        batch_size=32,
        epochs=1,
    )
    # (the guide's same fit with dicts left out: CI time; run_all.DEVIATIONS)
    train_dataset = tf.data.Dataset.from_tensor_slices(
        (
            {"img_input": img_data, "ts_input": ts_data},
            {"score_output": score_targets, "class_output": class_targets},
        )
    )
    train_dataset = train_dataset.shuffle(buffer_size=1024).batch(64)
    fit("multi_io_dataset", model, train_dataset, epochs=1)

# -- Using callbacks
with strategy.scope():
    model = get_compiled_model()
    callbacks = [
        keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=1e-2, patience=2, verbose=1)
    ]
    fit(
        "early_stopping",
        model,
        x_train,
        y_train,
        epochs=epochs(20, needed=4),
        batch_size=64,
        callbacks=callbacks,
        validation_split=0.2,
    )


class LossHistory(keras.callbacks.Callback):
    def on_train_begin(self, logs):
        self.per_batch_losses = []

    def on_batch_end(self, batch, logs):
        self.per_batch_losses.append(logs.get("loss"))


# -- Checkpointing models
with strategy.scope():
    model = get_compiled_model()
    callbacks = [
        keras.callbacks.ModelCheckpoint(
            filepath="mymodel_{epoch}.keras",
            save_best_only=True,
            monitor="val_loss",
            verbose=1,
        )
    ]
    fit(
        "checkpoint_best",
        model,
        x_train,
        y_train,
        epochs=2,
        batch_size=64,
        callbacks=callbacks,
        validation_split=0.2,
    )
numbers["checkpoint_best_files"] = sorted(f for f in os.listdir(".") if f.endswith(".keras"))

checkpoint_dir = "./ckpt"
if not os.path.exists(checkpoint_dir):
    os.makedirs(checkpoint_dir)


def make_or_restore_model():
    checkpoints = [checkpoint_dir + "/" + name for name in os.listdir(checkpoint_dir)]
    if checkpoints:
        latest_checkpoint = max(checkpoints, key=os.path.getctime)
        print("Restoring from", latest_checkpoint)
        numbers["restored_from"] = os.path.basename(latest_checkpoint)  # (report)
        return keras.models.load_model(latest_checkpoint)
    print("Creating a new model")
    return get_compiled_model()


with strategy.scope():
    model = make_or_restore_model()
    callbacks = [
        keras.callbacks.ModelCheckpoint(
            filepath=checkpoint_dir + "/model-loss={loss:.2f}.keras", save_freq=steps(100)
        )
    ]
    fit("checkpoint_every_batches", model, x_train, y_train, epochs=1, callbacks=callbacks)
numbers["checkpoint_every_batches_files"] = sorted(os.listdir(checkpoint_dir))

with strategy.scope():  # (not in the guide) what the checkpoints hold, read back
    restored = make_or_restore_model()
    numbers["restored_weights"] = checksum(restored.get_weights())
    numbers["restored_evaluate"] = restored.evaluate(x_test, y_test)

# -- Using learning rate schedules
initial_learning_rate = 0.1
lr_schedule = keras.optimizers.schedules.ExponentialDecay(
    initial_learning_rate, decay_steps=100000, decay_rate=0.96, staircase=True
)
with strategy.scope():
    optimizer = keras.optimizers.RMSprop(learning_rate=lr_schedule)

# -- Visualizing loss and metrics during training with TensorBoard (constructed only)
keras.callbacks.TensorBoard(
    log_dir="/full_path_to_your_logs",
    histogram_freq=0,
    embeddings_freq=0,
    update_freq="epoch",
)
report(numbers)
