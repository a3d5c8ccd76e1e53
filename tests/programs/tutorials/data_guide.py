"""Follows tensorflow/docs site/en/guide/data.ipynb ("tf.data: Build
TensorFlow input pipelines"), its sections "Iterator Checkpointing" and
"Using high-level APIs: tf.keras", call for call, under a strategy.

Iterator checkpointing: an iterator of ``Dataset.range(20)`` in a
``tf.train.Checkpoint`` with a step variable and a
``tf.train.CheckpointManager(max_to_keep=3)``; five elements, a save, five
more, a restore, five more. tf.keras: Fashion-MNIST scaled to [0, 1] with int32
labels, ``from_tensor_slices(...).shuffle(5000).batch(32)``, a Flatten/Dense
model compiled with Adam and ``SparseCategoricalCrossentropy(from_logits=True)``;
``fit`` for 2 epochs, ``fit`` of the repeated dataset with ``steps_per_epoch``,
``evaluate`` of the dataset and of the repeated one with ``steps``, ``predict``
of a dataset of images only and of the labelled one, with ``steps``.

Adapted (see _tutorial.py): the strategy line; the model built and compiled in
``strategy.scope()`` (the guide has no strategy); local Fashion-MNIST; 2 of the
20 and 10 steps; the checkpoint directory ``./my_ckpt`` in the working
directory, not ``/tmp/my_ckpt`` (shared by every run on the machine). The
guide's other sections (reading files, the Estimator section) are left out.
Run with the working directory as argv[1] and as the current directory.
"""

from _tutorial import begin, checksum, datasets, history, make_strategy, report, steps

begin(keras="keras3")

import numpy as np
import tensorflow as tf

strategy = make_strategy()

# -- Iterator Checkpointing
range_ds = tf.data.Dataset.range(20)

iterator = iter(range_ds)
ckpt = tf.train.Checkpoint(step=tf.Variable(0), iterator=iterator)
manager = tf.train.CheckpointManager(ckpt, "./my_ckpt", max_to_keep=3)

taken = [[next(iterator).numpy() for _ in range(5)]]
print(taken[-1])

save_path = manager.save()

taken.append([next(iterator).numpy() for _ in range(5)])
print(taken[-1])

ckpt.restore(manager.latest_checkpoint)

taken.append([next(iterator).numpy() for _ in range(5)])
print(taken[-1])

# -- Using high-level APIs: tf.keras
train, test = datasets.fashion_mnist.load_data()

images, labels = train
images = images / 255.0
labels = labels.astype(np.int32)

fmnist_train_ds = tf.data.Dataset.from_tensor_slices((images, labels))
fmnist_train_ds = fmnist_train_ds.shuffle(5000).batch(32)

with strategy.scope():
    model = tf.keras.Sequential([tf.keras.layers.Flatten(), tf.keras.layers.Dense(10)])

    model.compile(
        optimizer="adam",
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )

first_fit = model.fit(fmnist_train_ds, epochs=2)

repeated_fit = model.fit(fmnist_train_ds.repeat(), epochs=2, steps_per_epoch=steps(20))

loss, accuracy = model.evaluate(fmnist_train_ds)
print("Loss :", loss)
print("Accuracy :", accuracy)
evaluated = [loss, accuracy]

loss, accuracy = model.evaluate(fmnist_train_ds.repeat(), steps=steps(10))
print("Loss :", loss)
print("Accuracy :", accuracy)
evaluated_repeated = [loss, accuracy]

predict_ds = tf.data.Dataset.from_tensor_slices(images).batch(32)
result = model.predict(predict_ds, steps=steps(10))
print(result.shape)
predicted = [list(result.shape), checksum([result])]

result = model.predict(fmnist_train_ds, steps=steps(10))
print(result.shape)

report(
    {
        "iterator_elements": taken,
        "save_path": save_path,
        "fit": history(first_fit),
        "fit_repeated": history(repeated_fit),
        "evaluate": evaluated,
        "evaluate_repeated": evaluated_repeated,
        "predict_images": predicted,
        "predict_labelled": [list(result.shape), checksum([result])],
        "weights": checksum(model.get_weights()),
    }
)
