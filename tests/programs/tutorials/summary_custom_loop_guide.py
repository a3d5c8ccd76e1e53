"""Follows tensorflow/tensorboard docs/get_started.ipynb ("Get started with
TensorBoard"), call for call, under a strategy as a tf.distribute user would.

MNIST scaled to [0, 1] and ``create_model`` (Flatten, Dense(512), Dropout,
Dense(10, softmax)). "Using TensorBoard with Keras Model.fit()": the model
compiled and fit with validation data and the ``TensorBoard(histogram_freq=1)``
callback into ``logs/fit/<time>``. "Using TensorBoard with other methods": the
data as shuffled and batched ``tf.data`` datasets, Adam, the four stateful
metrics (Mean, SparseCategoricalAccuracy), train and test steps, two
``tf.summary.create_file_writer`` for ``logs/gradient_tape/<time>/train`` and
``.../test``; per epoch, the steps over the datasets, ``tf.summary.scalar`` of
each metric's result inside ``writer.as_default()``, the printed line and
``reset_states``. The event files of both sections are read back.

Adapted (see _tutorial.py): the strategy line; local MNIST; 2 of the 5 epochs
of each section. Under the strategy (the guide has none), as the custom
training tutorial does: the models, the optimizer and the metrics created in
``strategy.scope()``; the datasets distributed with
``experimental_distribute_dataset`` and each step run by ``strategy.run`` in a
``tf.function``; the loss object with ``reduction=NONE`` and the step's loss
``tf.nn.compute_average_loss`` of it (a Keras 2 loss with the default reduction
raises inside ``strategy.run``, under MirroredStrategy too), the Mean metrics
fed the per-example losses. ``<time>`` is a fixed string in place of
``datetime.now()``: the names of TensorBoard's run directories would differ in
every run (and could differ between the ranks of one run, as two processes'
clocks may read another second). The notebook's ``%tensorboard`` magics are
left out. Run with the working directory as argv[1] and as the current directory.
"""

from _tutorial import begin, checksum, datasets, epochs, events, history, make_strategy, report

begin(keras="tf_keras")  # Metric.reset_states (see _tutorial.py)

import tensorflow as tf

strategy = make_strategy()
current_time = "20240611-120000"  # datetime.datetime.now().strftime("%Y%m%d-%H%M%S")

# -- The data and the model
mnist = datasets.mnist

(x_train, y_train), (x_test, y_test) = mnist.load_data()
x_train, x_test = x_train / 255.0, x_test / 255.0


def create_model():
    return tf.keras.models.Sequential(
        [
            tf.keras.layers.Flatten(input_shape=(28, 28)),
            tf.keras.layers.Dense(512, activation="relu"),
            tf.keras.layers.Dropout(0.2),
            tf.keras.layers.Dense(10, activation="softmax"),
        ]
    )


# -- Using TensorBoard with Keras Model.fit()
with strategy.scope():
    model = create_model()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])

log_dir = "logs/fit/" + current_time
tensorboard_callback = tf.keras.callbacks.TensorBoard(log_dir=log_dir, histogram_freq=1)

fit_history = model.fit(
    x=x_train,
    y=y_train,
    epochs=epochs(5, needed=2),
    validation_data=(x_test, y_test),
    callbacks=[tensorboard_callback],
)
fit_weights = checksum(model.get_weights())

# -- Using TensorBoard with other methods: the datasets
train_dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train))
test_dataset = tf.data.Dataset.from_tensor_slices((x_test, y_test))

train_dataset = train_dataset.shuffle(60000).batch(64)
test_dataset = test_dataset.batch(64)

train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

# -- Loss, optimizer and metrics
with strategy.scope():
    loss_object = tf.keras.losses.SparseCategoricalCrossentropy(
        reduction=tf.keras.losses.Reduction.NONE
    )
    optimizer = tf.keras.optimizers.Adam()

    # Define our metrics
    train_loss = tf.keras.metrics.Mean("train_loss", dtype=tf.float32)
    train_accuracy = tf.keras.metrics.SparseCategoricalAccuracy("train_accuracy")
    test_loss = tf.keras.metrics.Mean("test_loss", dtype=tf.float32)
    test_accuracy = tf.keras.metrics.SparseCategoricalAccuracy("test_accuracy")


def train_step(model, optimizer, x_train, y_train):
    with tf.GradientTape() as tape:
        predictions = model(x_train, training=True)
        per_example_loss = loss_object(y_train, predictions)
        loss = tf.nn.compute_average_loss(per_example_loss)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

    train_loss(per_example_loss)
    train_accuracy(y_train, predictions)


def test_step(model, x_test, y_test):
    predictions = model(x_test)
    loss = loss_object(y_test, predictions)

    test_loss(loss)
    test_accuracy(y_test, predictions)


@tf.function
def distributed_train_step(x_train, y_train):  # (the strategy's steps)
    strategy.run(train_step, args=(model, optimizer, x_train, y_train))


@tf.function
def distributed_test_step(x_test, y_test):
    strategy.run(test_step, args=(model, x_test, y_test))


# -- The summary writers
train_log_dir = "logs/gradient_tape/" + current_time + "/train"
test_log_dir = "logs/gradient_tape/" + current_time + "/test"
train_summary_writer = tf.summary.create_file_writer(train_log_dir)
test_summary_writer = tf.summary.create_file_writer(test_log_dir)

# -- Training, with the metrics logged per epoch
with strategy.scope():
    model = create_model()  # reset our model

EPOCHS = epochs(5, needed=2)
printed = []  # (report) the numbers of each printed line

for epoch in range(EPOCHS):
    for x_train, y_train in train_dist_dataset:
        distributed_train_step(x_train, y_train)
    with train_summary_writer.as_default():
        tf.summary.scalar("loss", train_loss.result(), step=epoch)
        tf.summary.scalar("accuracy", train_accuracy.result(), step=epoch)

    for x_test, y_test in test_dist_dataset:
        distributed_test_step(x_test, y_test)
    with test_summary_writer.as_default():
        tf.summary.scalar("loss", test_loss.result(), step=epoch)
        tf.summary.scalar("accuracy", test_accuracy.result(), step=epoch)

    template = "Epoch {}, Loss: {}, Accuracy: {}, Test Loss: {}, Test Accuracy: {}"
    line = [
        epoch + 1,
        train_loss.result(),
        train_accuracy.result() * 100,
        test_loss.result(),
        test_accuracy.result() * 100,
    ]
    print(template.format(*line))
    printed.append(line)

    # Reset metrics every epoch
    train_loss.reset_states()
    test_loss.reset_states()
    train_accuracy.reset_states()
    test_accuracy.reset_states()

report(
    {
        "fit": history(fit_history),
        "fit_weights": fit_weights,
        "fit_events": events("logs/fit"),
        "printed": printed,
        "weights": checksum(model.get_weights()),
        "gradient_tape_events": events("logs/gradient_tape"),
    }
)
