"""Follows tensorflow/docs site/en/tutorials/distribute/keras.ipynb
("Distributed training with Keras"), call for call.

MNIST from tfds, the strategy, the input pipeline (map/cache/shuffle/batch
with BATCH_SIZE_PER_REPLICA * num_replicas_in_sync), a CNN built and compiled
in strategy.scope(), Model.fit with the TensorBoard, ModelCheckpoint
(``ckpt_{epoch:04d}.weights.h5``, weights only), LearningRateScheduler and
PrintLR callbacks, Model.load_weights of the newest checkpoint file and
Model.evaluate, Model.save to ``my_model.keras``, and load_model + compile +
evaluate outside and inside strategy.scope().

Adapted (see _tutorial.py): the strategy line; local MNIST; 8 of the 12
epochs (enough for all three rates of ``decay``). The notebook's shell and
TensorBoard magics (``!ls``, ``%tensorboard``) become directory listings.
Run with the working directory as argv[1] and as the current directory.
"""

from _tutorial import begin, checksum, epochs, history, make_strategy, report, tfds

begin(keras="keras3")  # its .weights.h5 checkpoints need Keras 3 (see _tutorial.py)

import os

import tensorflow as tf

print(tf.__version__)

# -- The data, from TensorFlow Datasets (here: local)
datasets, info = tfds.load(name="mnist", with_info=True, as_supervised=True)
mnist_train, mnist_test = datasets["train"], datasets["test"]

# -- The strategy
strategy = make_strategy()
print(f"Number of devices: {strategy.num_replicas_in_sync}")

# -- The input pipeline: a global batch of 64 examples per replica
num_train_examples = info.splits["train"].num_examples
num_test_examples = info.splits["test"].num_examples

BUFFER_SIZE = 10000
BATCH_SIZE_PER_REPLICA = 64
BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync


def scale(image, label):
    image = tf.cast(image, tf.float32)
    image /= 255
    return image, label


train_dataset = mnist_train.map(scale).cache().shuffle(BUFFER_SIZE).batch(BATCH_SIZE)
eval_dataset = mnist_test.map(scale).batch(BATCH_SIZE)

# -- The model, built and compiled in the scope
with strategy.scope():
    model = tf.keras.Sequential(
        [
            tf.keras.layers.Conv2D(32, 3, activation="relu", input_shape=(28, 28, 1)),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(64, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )
    model.compile(
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.Adam(learning_rate=0.001),
        metrics=["accuracy"],
    )

# -- The callbacks
checkpoint_dir = "./training_checkpoints"
checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch:04d}.weights.h5")


def decay(epoch):
    if epoch < 3:
        return 1e-3
    elif epoch >= 3 and epoch < 7:
        return 1e-4
    else:
        return 1e-5


printed_rates = []  # (report) what PrintLR printed


class PrintLR(tf.keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        rate = model.optimizer.learning_rate.numpy()
        print(f"\nLearning rate for epoch {epoch + 1} is {rate}")
        printed_rates.append(rate)


callbacks = [
    tf.keras.callbacks.TensorBoard(log_dir="./logs"),
    tf.keras.callbacks.ModelCheckpoint(filepath=checkpoint_prefix, save_weights_only=True),
    tf.keras.callbacks.LearningRateScheduler(decay),
    PrintLR(),
]

# -- Training, then the newest checkpoint file loaded and evaluated
EPOCHS = epochs(12, needed=8)

fit_history = model.fit(train_dataset, epochs=EPOCHS, callbacks=callbacks)

checkpoint_files = sorted(os.listdir(checkpoint_dir))  # the notebook's `!ls {checkpoint_dir}`
print(checkpoint_files)

import pathlib

latest_checkpoint = sorted(pathlib.Path(checkpoint_dir).glob("*"))[-1]
model.load_weights(latest_checkpoint)

eval_loss, eval_acc = model.evaluate(eval_dataset)
print(f"Eval loss: {eval_loss}, Eval accuracy: {eval_acc}")
evaluated_after_load_weights = [eval_loss, eval_acc]

log_dirs = sorted(os.listdir("./logs"))  # the notebook's `!ls -sh ./logs`
print(log_dirs)

# -- The whole model saved, and loaded outside and inside the scope
path = "my_model.keras"
model.save(path)

unreplicated_model = tf.keras.models.load_model(path)
unreplicated_model.compile(
    loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    optimizer=tf.keras.optimizers.Adam(),
    metrics=["accuracy"],
)
eval_loss, eval_acc = unreplicated_model.evaluate(eval_dataset)
print(f"Eval loss: {eval_loss}, Eval Accuracy: {eval_acc}")
evaluated_unreplicated = [eval_loss, eval_acc]

with strategy.scope():
    replicated_model = tf.keras.models.load_model(path)
    replicated_model.compile(
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.Adam(),
        metrics=["accuracy"],
    )
    eval_loss, eval_acc = replicated_model.evaluate(eval_dataset)
    print(f"Eval loss: {eval_loss}, Eval Accuracy: {eval_acc}")

report(
    {
        "num_replicas_in_sync": strategy.num_replicas_in_sync,
        "global_batch_size": BATCH_SIZE,
        "fit": history(fit_history),
        "printed_learning_rates": printed_rates,
        "checkpoint_files": checkpoint_files,
        "latest_checkpoint": latest_checkpoint.name,
        "tensorboard_log_dirs": log_dirs,
        "evaluate_after_load_weights": evaluated_after_load_weights,
        "evaluate_loaded_without_scope": evaluated_unreplicated,
        "evaluate_loaded_in_scope": [eval_loss, eval_acc],
        "weights": checksum(model.get_weights()),
        "loaded_weights": checksum(replicated_model.get_weights()),
    }
)
