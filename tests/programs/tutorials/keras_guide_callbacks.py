"""Follows keras-team/keras-io guides/keras_core/writing_your_own_callbacks.py
("Writing your own callbacks", Keras 3; guides/writing_your_own_callbacks.py
is its tf.keras version), call for call.

A one-unit Dense regression of MNIST's labels compiled with RMSprop, MSE and
MAE; a callback with every hook printing the keys of its logs, passed to fit
(with validation_split), evaluate and predict; a callback printing the loss of
each train and test batch and the epoch's loss and MAE; an early stopping
callback that keeps the best weights (get_weights), sets stop_training and
restores them (set_weights); a learning rate scheduler callback that reads and
sets optimizer.learning_rate at each epoch's start.

Moved onto tf.distribute as the guide distributed_training_with_tensorflow.py
says, the same under both strategies: each model built and compiled in
strategy.scope() (get_model), fit, evaluate and predict called there too.

Adapted (see _tutorial.py): the strategy line; local MNIST (400 training and
200 test examples: the guide limits MNIST to 1,000 of each); 5 of the early
stopping fit's 30 epochs and 7 of the scheduled fit's 15 (through the
schedule's changes at epochs 3 and 6). What the callbacks print is also kept
for the report. Run with the working directory as argv[1] and as the current
directory.
"""

from _tutorial import begin, checksum, datasets, epochs, history, make_strategy, report

begin(keras="keras3")  # the guide is written for Keras 3

import keras
import numpy as np

numbers = {}  # (report)
strategy = make_strategy()


def get_model():
    model = keras.Sequential()
    model.add(keras.layers.Dense(1))
    model.compile(
        optimizer=keras.optimizers.RMSprop(learning_rate=0.1),
        loss="mean_squared_error",
        metrics=["mean_absolute_error"],
    )
    return model


(x_train, y_train), (x_test, y_test) = datasets.mnist.load_data()
x_train = x_train.reshape(-1, 784).astype("float32") / 255.0
x_test = x_test.reshape(-1, 784).astype("float32") / 255.0

x_train = x_train[:1000]
y_train = y_train[:1000]
x_test = x_test[:1000]
y_test = y_test[:1000]

seen = numbers["custom_callback_log_keys"] = []  # (report) what CustomCallback printed


class CustomCallback(keras.callbacks.Callback):
    def _print(self, what, logs):
        keys = list(logs.keys())
        print(f"{what}; got log keys: {keys}")
        seen.append([what, sorted(keys)])

    def on_train_begin(self, logs=None):
        self._print("Starting training", logs)

    def on_train_end(self, logs=None):
        self._print("Stop training", logs)

    def on_epoch_begin(self, epoch, logs=None):
        self._print(f"Start epoch {epoch} of training", logs)

    def on_epoch_end(self, epoch, logs=None):
        self._print(f"End epoch {epoch} of training", logs)

    def on_test_begin(self, logs=None):
        self._print("Start testing", logs)

    def on_test_end(self, logs=None):
        self._print("Stop testing", logs)

    def on_predict_begin(self, logs=None):
        self._print("Start predicting", logs)

    def on_predict_end(self, logs=None):
        self._print("Stop predicting", logs)

    def on_train_batch_begin(self, batch, logs=None):
        self._print(f"...Training: start of batch {batch}", logs)

    def on_train_batch_end(self, batch, logs=None):
        self._print(f"...Training: end of batch {batch}", logs)

    def on_test_batch_begin(self, batch, logs=None):
        self._print(f"...Evaluating: start of batch {batch}", logs)

    def on_test_batch_end(self, batch, logs=None):
        self._print(f"...Evaluating: end of batch {batch}", logs)

    def on_predict_batch_begin(self, batch, logs=None):
        self._print(f"...Predicting: start of batch {batch}", logs)

    def on_predict_batch_end(self, batch, logs=None):
        self._print(f"...Predicting: end of batch {batch}", logs)


with strategy.scope():
    model = get_model()
    fit = model.fit(
        x_train,
        y_train,
        batch_size=128,
        epochs=1,
        verbose=0,
        validation_split=0.5,
        callbacks=[CustomCallback()],
    )
    numbers["custom_callback_fit"] = history(fit)
    res = model.evaluate(x_test, y_test, batch_size=128, verbose=0, callbacks=[CustomCallback()])
    numbers["custom_callback_evaluate"] = res
    res = model.predict(x_test, batch_size=128, callbacks=[CustomCallback()])
    numbers["custom_callback_predict"] = [res.shape, float(np.sum(np.abs(res)))]

printed = []  # (report) what LossAndErrorPrintingCallback printed


class LossAndErrorPrintingCallback(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        print("Up to batch {}, the average loss is {:7.2f}.".format(batch, logs["loss"]))
        printed.append(["train batch", batch, logs["loss"]])

    def on_test_batch_end(self, batch, logs=None):
        print("Up to batch {}, the average loss is {:7.2f}.".format(batch, logs["loss"]))
        printed.append(["test batch", batch, logs["loss"]])

    def on_epoch_end(self, epoch, logs=None):
        print(
            "The average loss for epoch {} is {:7.2f} and mean absolute error is {:7.2f}.".format(
                epoch, logs["loss"], logs["mean_absolute_error"]
            )
        )
        printed.append(["epoch", epoch, logs["loss"], logs["mean_absolute_error"]])


with strategy.scope():
    model = get_model()
    fit = model.fit(
        x_train,
        y_train,
        batch_size=128,
        epochs=2,
        verbose=0,
        callbacks=[LossAndErrorPrintingCallback()],
    )
    res = model.evaluate(
        x_test,
        y_test,
        batch_size=128,
        verbose=0,
        callbacks=[LossAndErrorPrintingCallback()],
    )
numbers["printing_fit"] = history(fit)
numbers["printing_evaluate"] = res
numbers["printing_printed"] = list(printed)
printed.clear()


class EarlyStoppingAtMinLoss(keras.callbacks.Callback):
    def __init__(self, patience=0):
        super().__init__()
        self.patience = patience
        self.best_weights = None

    def on_train_begin(self, logs=None):
        self.wait = 0
        self.stopped_epoch = 0
        self.best = np.inf  # (the guide's np.Inf, removed in NumPy 2)

    def on_epoch_end(self, epoch, logs=None):
        current = logs.get("loss")
        if np.less(current, self.best):
            self.best = current
            self.wait = 0
            self.best_weights = self.model.get_weights()
        else:
            self.wait += 1
            if self.wait >= self.patience:
                self.stopped_epoch = epoch
                self.model.stop_training = True
                print("Restoring model weights from the end of the best epoch.")
                self.model.set_weights(self.best_weights)

    def on_train_end(self, logs=None):
        if self.stopped_epoch > 0:
            print(f"Epoch {self.stopped_epoch + 1}: early stopping")


with strategy.scope():
    model = get_model()
    early_stopping = EarlyStoppingAtMinLoss()
    fit = model.fit(
        x_train,
        y_train,
        batch_size=64,
        epochs=epochs(30, needed=5),
        verbose=0,
        callbacks=[LossAndErrorPrintingCallback(), early_stopping],
    )
numbers["early_stopping_fit"] = history(fit)
numbers["early_stopping_stopped_epoch"] = early_stopping.stopped_epoch
numbers["early_stopping_best"] = float(early_stopping.best)
numbers["early_stopping_weights"] = checksum(model.get_weights())
numbers["early_stopping_printed"] = list(printed)
printed.clear()


class CustomLearningRateScheduler(keras.callbacks.Callback):
    def __init__(self, schedule):
        super().__init__()
        self.schedule = schedule

    def on_epoch_begin(self, epoch, logs=None):
        if not hasattr(self.model.optimizer, "learning_rate"):
            raise ValueError('Optimizer must have a "learning_rate" attribute.')
        lr = self.model.optimizer.learning_rate
        scheduled_lr = self.schedule(epoch, lr)
        self.model.optimizer.learning_rate = scheduled_lr
        print(f"\nEpoch {epoch}: Learning rate is {float(np.array(scheduled_lr))}.")
        scheduled.append(float(np.array(scheduled_lr)))


LR_SCHEDULE = [
    (3, 0.05),
    (6, 0.01),
    (9, 0.005),
    (12, 0.001),
]


def lr_schedule(epoch, lr):
    if epoch < LR_SCHEDULE[0][0] or epoch > LR_SCHEDULE[-1][0]:
        return lr
    for i in range(len(LR_SCHEDULE)):
        if epoch == LR_SCHEDULE[i][0]:
            return LR_SCHEDULE[i][1]
    return lr


scheduled = []  # (report) the printed learning rates
with strategy.scope():
    model = get_model()
    fit = model.fit(
        x_train,
        y_train,
        batch_size=64,
        epochs=epochs(15, needed=7),
        verbose=0,
        callbacks=[
            LossAndErrorPrintingCallback(),
            CustomLearningRateScheduler(lr_schedule),
        ],
    )
numbers["scheduled_fit"] = history(fit)
numbers["scheduled_learning_rates"] = scheduled
numbers["scheduled_printed"] = list(printed)
numbers["scheduled_weights"] = checksum(model.get_weights())
report(numbers)
