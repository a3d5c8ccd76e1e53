"""Follows tensorflow/docs site/en/guide/distributed_training.ipynb
("Distributed training with TensorFlow"), call for call.

The strategies the guide creates; the default strategy from
tf.distribute.get_strategy() and its reduce; a variable made in the scope of
the default strategy; Keras: a Dense model with an L2 regularizer built and
compiled in strategy.scope(), Model.fit and Model.evaluate on a dataset, and
Model.fit on NumPy arrays with batch_size; num_replicas_in_sync and a global
batch size (with the guide's learning rate by batch size); a custom training
loop: model and SGD in scope, experimental_distribute_dataset, a
BinaryCrossentropy(reduction=NONE) loss with compute_average_loss and
scale_regularization_loss, strategy.run and strategy.reduce(SUM) in a
tf.function, iterated with for and with next(iter(...)).

Adapted (see _tutorial.py): each strategy line. The guide's overview creates
MirroredStrategy with GPU devices, with HierarchicalCopyAllReduce,
MultiWorkerMirroredStrategy with and without NCCL communication options, and
CentralStorageStrategy; none of them trains and their arguments name hardware
this machine lacks, so each is the strategy of make_strategy(). The guide's
data are already small and synthetic.
Run with the working directory as argv[1] and as the current directory.
"""

from _tutorial import begin, checksum, history, make_strategy, report

begin(keras="keras3")  # either Keras runs it; the default one

import tensorflow as tf

numbers = {}  # (report)

# -- Types of strategies (constructed only)
mirrored_strategy = make_strategy()  # MirroredStrategy()
mirrored_strategy = make_strategy()  # MirroredStrategy(devices=[gpus])
mirrored_strategy = make_strategy()  # (cross_device_ops=HierarchicalCopyAllReduce())
strategy = make_strategy()  # MultiWorkerMirroredStrategy()
communication_options = tf.distribute.experimental.CommunicationOptions(
    implementation=tf.distribute.experimental.CommunicationImplementation.NCCL
)
strategy = make_strategy()  # (communication_options=...)
central_storage_strategy = make_strategy()  # CentralStorageStrategy()

# -- The default strategy
default_strategy = tf.distribute.get_strategy()

strategy = tf.distribute.get_strategy()
numbers["default_strategy_reduce"] = strategy.reduce("SUM", 1.0, axis=None)

if tf.config.list_physical_devices("GPU"):
    strategy = make_strategy()
else:
    strategy = tf.distribute.get_strategy()

with strategy.scope():
    print(tf.Variable(1.0))

# -- Use tf.distribute.Strategy with Keras Model.fit
mirrored_strategy = make_strategy()
with mirrored_strategy.scope():
    model = tf.keras.Sequential(
        [
            tf.keras.layers.Dense(
                1, input_shape=(1,), kernel_regularizer=tf.keras.regularizers.L2(1e-4)
            )
        ]
    )
    model.compile(loss="mse", optimizer="sgd")

dataset = tf.data.Dataset.from_tensors(([1.0], [1.0])).repeat(100).batch(10)
numbers["fit_dataset"] = history(model.fit(dataset, epochs=2))
numbers["evaluate_dataset"] = model.evaluate(dataset)

import numpy as np

inputs, targets = np.ones((100, 1)), np.ones((100, 1))
numbers["fit_numpy"] = history(model.fit(inputs, targets, epochs=2, batch_size=10))
numbers["keras_weights"] = checksum(model.get_weights())

print(mirrored_strategy.num_replicas_in_sync)
numbers["num_replicas_in_sync"] = mirrored_strategy.num_replicas_in_sync

BATCH_SIZE_PER_REPLICA = 5
global_batch_size = BATCH_SIZE_PER_REPLICA * mirrored_strategy.num_replicas_in_sync
dataset = tf.data.Dataset.from_tensors(([1.0], [1.0])).repeat(100)
dataset = dataset.batch(global_batch_size)

LEARNING_RATES_BY_BATCH_SIZE = {5: 0.1, 10: 0.15, 20: 0.175}
learning_rate = LEARNING_RATES_BY_BATCH_SIZE[global_batch_size]
numbers["learning_rate"] = learning_rate

# -- Use tf.distribute.Strategy with custom training loops
with mirrored_strategy.scope():
    model = tf.keras.Sequential(
        [
            tf.keras.layers.Dense(
                1, input_shape=(1,), kernel_regularizer=tf.keras.regularizers.L2(1e-4)
            )
        ]
    )
    optimizer = tf.keras.optimizers.SGD()

dataset = tf.data.Dataset.from_tensors(([1.0], [1.0])).repeat(1000).batch(global_batch_size)
dist_dataset = mirrored_strategy.experimental_distribute_dataset(dataset)

loss_object = tf.keras.losses.BinaryCrossentropy(
    from_logits=True, reduction=tf.keras.losses.Reduction.NONE
)


def train_step(inputs):
    features, labels = inputs

    with tf.GradientTape() as tape:
        predictions = model(features, training=True)
        per_example_loss = loss_object(labels, predictions)
        loss = tf.nn.compute_average_loss(per_example_loss)
        model_losses = model.losses
        if model_losses:
            loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))

    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return loss


@tf.function
def distributed_train_step(dist_inputs):
    per_replica_losses = mirrored_strategy.run(train_step, args=(dist_inputs,))
    return mirrored_strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)


numbers["for_loop_losses"] = []
for dist_inputs in dist_dataset:
    loss = distributed_train_step(dist_inputs)
    print(loss)
    numbers["for_loop_losses"].append(loss)

iterator = iter(dist_dataset)
numbers["iterator_losses"] = []
for _ in range(10):
    loss = distributed_train_step(next(iterator))
    print(loss)
    numbers["iterator_losses"].append(loss)

numbers["loop_weights"] = checksum(model.get_weights())
report(numbers)
