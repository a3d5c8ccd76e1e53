"""Follows tensorflow/docs site/en/tutorials/distribute/save_and_load.ipynb
("Save and load a model using a distribution strategy"), call for call.

A model built and compiled in strategy.scope() and trained with Model.fit on
MNIST from tfds; Model.save to a ``.keras`` file; load_model without a
strategy and fit; load_model and fit under OneDeviceStrategy; a fresh model
saved with tf.saved_model.save; tf.saved_model.load and its
``serving_default`` signature called on a batch, outside and (per replica,
with strategy.run on a distributed dataset) inside a strategy's scope;
Model.save to a SavedModel directory then tf.saved_model.load in a scope;
saving with SaveOptions(experimental_io_device='/job:localhost') and
load_model with LoadOptions in a scope; the caveat of a subclassed model:
Model.save before it has traced a call (the ValueError), tf.saved_model.save
and load of it (no signatures), Model.save_spec before and after
Model.fit, and Model.save after fit.

Adapted (see _tutorial.py): each strategy line (the tutorial's
``MirroredStrategy()``s; its ``OneDeviceStrategy('/cpu:0')`` is kept); local
MNIST; the tutorial's /tmp paths (``/tmp/keras_save.keras``,
``/tmp/tf_save``) are in the working directory. Not reproduced: the section
that wraps the loaded SavedModel in ``tensorflow_hub``'s ``hub.KerasLayer``
and trains it (tensorflow_hub is not a dependency of this project).
Run with the working directory as argv[1] and as the current directory.
"""

from _tutorial import all_workers, begin, checksum, history, make_strategy, report, tfds

begin(keras="tf_keras")  # Model.save to a SavedModel directory, save_spec (see _tutorial.py)

import numpy as np
import tensorflow as tf

numbers = {}  # (report)

# -- The strategy, the data and a model compiled in the scope
mirrored_strategy = make_strategy()


def get_data():
    datasets = tfds.load(name="mnist", as_supervised=True)
    mnist_train, mnist_test = datasets["train"], datasets["test"]

    BUFFER_SIZE = 10000
    BATCH_SIZE_PER_REPLICA = 64
    BATCH_SIZE = BATCH_SIZE_PER_REPLICA * mirrored_strategy.num_replicas_in_sync

    def scale(image, label):
        image = tf.cast(image, tf.float32)
        image /= 255
        return image, label

    train_dataset = mnist_train.map(scale).cache().shuffle(BUFFER_SIZE).batch(BATCH_SIZE)
    eval_dataset = mnist_test.map(scale).batch(BATCH_SIZE)
    return train_dataset, eval_dataset


def get_model():
    with mirrored_strategy.scope():
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
            optimizer=tf.keras.optimizers.Adam(),
            metrics=[tf.metrics.SparseCategoricalAccuracy()],
        )
        return model


model = get_model()
train_dataset, eval_dataset = get_data()
numbers["fit"] = history(model.fit(train_dataset, epochs=2))

# -- Keras: Model.save to .keras; load_model without a strategy, and under another one
keras_model_path = "keras_save.keras"
model.save(keras_model_path)

restored_keras_model = tf.keras.models.load_model(keras_model_path)
numbers["restored_weights"] = checksum(restored_keras_model.get_weights())
numbers["restored_fit"] = history(restored_keras_model.fit(train_dataset, epochs=2))

another_strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
with another_strategy.scope():
    restored_keras_model_ds = tf.keras.models.load_model(keras_model_path)
    numbers["restored_one_device_fit"] = history(
        restored_keras_model_ds.fit(train_dataset, epochs=2)
    )

# -- tf.saved_model: save an untrained model, load it, call its serving signature
model = get_model()
saved_model_path = "tf_save"
tf.saved_model.save(model, saved_model_path)
numbers["fresh_model_weights"] = checksum(model.get_weights())

DEFAULT_FUNCTION_KEY = "serving_default"
loaded = tf.saved_model.load(saved_model_path)
inference_func = loaded.signatures[DEFAULT_FUNCTION_KEY]

predict_dataset = eval_dataset.map(lambda image, label: image)
for batch in predict_dataset.take(1):
    print(inference_func(batch))
    numbers["inference"] = {k: checksum([v]) for k, v in inference_func(batch).items()}

# ... and per replica, loaded in a strategy's scope
another_strategy = make_strategy()
with another_strategy.scope():
    loaded = tf.saved_model.load(saved_model_path)
    inference_func = loaded.signatures[DEFAULT_FUNCTION_KEY]
    dist_predict_dataset = another_strategy.experimental_distribute_dataset(predict_dataset)
    for batch in dist_predict_dataset:
        result = another_strategy.run(inference_func, args=(batch,))
        print(result)
        # (report) every replica's outputs of this first batch, from all workers
        local = {
            k: [np.asarray(t) for t in another_strategy.experimental_local_results(v)]
            for k, v in result.items()
        }
        numbers["distributed_inference"] = {
            k: checksum([np.concatenate([t for worker in all_workers(local) for t in worker[k]])])
            for k in local
        }
        break

# (the hub.KerasLayer section is not reproduced: see the docstring)

# -- Mixing the APIs: Model.save to a SavedModel directory, tf.saved_model.load in a scope
model = get_model()
model.save(saved_model_path)

another_strategy = make_strategy()
with another_strategy.scope():
    loaded = tf.saved_model.load(saved_model_path)
    numbers["low_level_loaded_variables"] = checksum(
        sorted((v.numpy() for v in loaded.variables), key=lambda a: (a.shape, a.sum()))
    )

# -- Saving and loading through the local I/O device
model = get_model()
saved_model_path = "tf_save"
save_options = tf.saved_model.SaveOptions(experimental_io_device="/job:localhost")
model.save(saved_model_path, options=save_options)

another_strategy = make_strategy()
with another_strategy.scope():
    load_options = tf.saved_model.LoadOptions(experimental_io_device="/job:localhost")
    loaded = tf.keras.models.load_model(saved_model_path, options=load_options)
numbers["localhost_saved_weights"] = checksum(model.get_weights())
numbers["localhost_loaded_weights"] = checksum(loaded.get_weights())


# -- Caveats: a subclassed model saved before and after it has traced a call
class SubclassedModel(tf.keras.Model):
    output_name = "output_layer"

    def __init__(self):
        super().__init__()
        self._dense_layer = tf.keras.layers.Dense(5, dtype=tf.dtypes.float32, name=self.output_name)

    def call(self, inputs):
        return self._dense_layer(inputs)


my_model = SubclassedModel()
try:
    my_model.save(saved_model_path)
except ValueError as e:
    print(f"{type(e).__name__}: ", *e.args)
    numbers["unbuilt_save_error"] = type(e).__name__

tf.saved_model.save(my_model, saved_model_path)
x = tf.saved_model.load(saved_model_path)
print(x.signatures)
numbers["unbuilt_signatures"] = sorted(x.signatures.keys())

print(my_model.save_spec() is None)
numbers["save_spec_is_none_before_fit"] = my_model.save_spec() is None

BATCH_SIZE_PER_REPLICA = 4
BATCH_SIZE = BATCH_SIZE_PER_REPLICA * mirrored_strategy.num_replicas_in_sync

dataset_size = 100
dataset = (
    tf.data.Dataset.from_tensors((tf.range(5, dtype=tf.float32), tf.range(5, dtype=tf.float32)))
    .repeat(dataset_size)
    .batch(BATCH_SIZE)
)

my_model.compile(optimizer="adam", loss="mean_squared_error")
numbers["subclassed_fit"] = history(my_model.fit(dataset, epochs=2))

print(my_model.save_spec() is None)
numbers["save_spec_is_none_after_fit"] = my_model.save_spec() is None
my_model.save(saved_model_path)
numbers["subclassed_weights"] = checksum(my_model.get_weights())

report(numbers)
