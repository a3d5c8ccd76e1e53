"""Follows tensorflow/docs site/en/tutorials/distribute/custom_training.ipynb
("Custom training with tf.distribute.Strategy"), call for call.

Fashion-MNIST arrays, the strategy, from_tensor_slices/shuffle/batch with
GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * num_replicas_in_sync,
experimental_distribute_dataset for training and test data; in
strategy.scope(): a SparseCategoricalCrossentropy(reduction=NONE) loss with
tf.nn.compute_average_loss and scale_regularization_loss, Mean and
SparseCategoricalAccuracy metrics, the model (L2-regularized CNN), Adam and a
tf.train.Checkpoint. Training and test steps run by strategy.run in
tf.function, the loss reduced with strategy.reduce(SUM); a checkpoint saved
(Checkpoint.save) every second epoch; metrics read and reset_states() each
epoch. Then the latest checkpoint restored into a new model and optimizer
built without a strategy and evaluated on undistributed data; then training
resumed with an explicit iterator (next(iter(...)) for a fixed number of
steps); then a whole epoch per tf.function call (iterating the distributed
dataset inside tf.function).

Adapted (see _tutorial.py): the strategy line; local Fashion-MNIST; 3 of the
10 epochs (two checkpoints, so that the latest one is restored); 3 of the 10
steps of the explicit-iterator loop (the local data has 4 batches, not 469).
Run with the working directory as argv[1] and as the current directory.
"""

from _tutorial import begin, checksum, datasets, epochs, make_strategy, report, steps

begin(keras="tf_keras")  # Metric.reset_states (see _tutorial.py)

import os

import numpy as np
import tensorflow as tf

print(tf.__version__)

# -- The data: Fashion-MNIST arrays, a channel axis, scaled to [0, 1]
fashion_mnist = datasets.fashion_mnist
(train_images, train_labels), (test_images, test_labels) = fashion_mnist.load_data()

train_images = train_images[..., None]
test_images = test_images[..., None]
train_images = train_images / np.float32(255)
test_images = test_images / np.float32(255)

# -- The strategy
strategy = make_strategy()
print(f"Number of devices: {strategy.num_replicas_in_sync}")

# -- The input pipeline
BUFFER_SIZE = len(train_images)
BATCH_SIZE_PER_REPLICA = 64
GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
EPOCHS = epochs(10, needed=3)

train_dataset = (
    tf.data.Dataset.from_tensor_slices((train_images, train_labels))
    .shuffle(BUFFER_SIZE)
    .batch(GLOBAL_BATCH_SIZE)
)
test_dataset = tf.data.Dataset.from_tensor_slices((test_images, test_labels)).batch(
    GLOBAL_BATCH_SIZE
)

train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)


# -- The model
def create_model():
    regularizer = tf.keras.regularizers.L2(1e-5)
    model = tf.keras.Sequential(
        [
            tf.keras.layers.Conv2D(32, 3, activation="relu", kernel_regularizer=regularizer),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Conv2D(64, 3, activation="relu", kernel_regularizer=regularizer),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(64, activation="relu", kernel_regularizer=regularizer),
            tf.keras.layers.Dense(10, kernel_regularizer=regularizer),
        ]
    )
    return model


checkpoint_dir = "./training_checkpoints"
checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt")

# -- The loss: per example, averaged over the global batch, plus regularization
with strategy.scope():
    loss_object = tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=tf.keras.losses.Reduction.NONE
    )

    def compute_loss(labels, predictions, model_losses):
        per_example_loss = loss_object(labels, predictions)
        loss = tf.nn.compute_average_loss(per_example_loss)
        if model_losses:
            loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
        return loss


# -- The metrics
with strategy.scope():
    test_loss = tf.keras.metrics.Mean(name="test_loss")
    train_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
    test_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(name="test_accuracy")

# -- The model, the optimizer and the checkpoint, in the scope
with strategy.scope():
    model = create_model()
    optimizer = tf.keras.optimizers.Adam(learning_rate=0.001)
    checkpoint = tf.train.Checkpoint(optimizer=optimizer, model=model)


def train_step(inputs):
    images, labels = inputs
    with tf.GradientTape() as tape:
        predictions = model(images, training=True)
        loss = compute_loss(labels, predictions, model.losses)
    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    train_accuracy.update_state(labels, predictions)
    return loss


def test_step(inputs):
    images, labels = inputs
    predictions = model(images, training=False)
    t_loss = loss_object(labels, predictions)
    test_loss.update_state(t_loss)
    test_accuracy.update_state(labels, predictions)


@tf.function
def distributed_train_step(dataset_inputs):
    per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)


@tf.function
def distributed_test_step(dataset_inputs):
    return strategy.run(test_step, args=(dataset_inputs,))


first_loop = []  # (report) what each epoch printed

for epoch in range(EPOCHS):
    total_loss = 0.0
    num_batches = 0
    for x in train_dist_dataset:
        total_loss += distributed_train_step(x)
        num_batches += 1
    train_loss = total_loss / num_batches

    for x in test_dist_dataset:
        distributed_test_step(x)

    if epoch % 2 == 0:
        checkpoint.save(checkpoint_prefix)

    print(
        f"Epoch {epoch + 1}, Loss: {train_loss}, Accuracy: {train_accuracy.result() * 100}, "
        f"Test Loss: {test_loss.result()}, Test Accuracy: {test_accuracy.result() * 100}"
    )
    first_loop.append(
        [
            train_loss,
            train_accuracy.result() * 100,
            test_loss.result(),
            test_accuracy.result() * 100,
        ]
    )

    test_loss.reset_states()
    train_accuracy.reset_states()
    test_accuracy.reset_states()

checkpoint_files = sorted(os.listdir(checkpoint_dir))
weights_after_first_loop = checksum(model.get_weights())

# -- The latest checkpoint restored into a model made without the strategy
eval_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(name="eval_accuracy")
new_model = create_model()
new_optimizer = tf.keras.optimizers.Adam()
test_dataset = tf.data.Dataset.from_tensor_slices((test_images, test_labels)).batch(
    GLOBAL_BATCH_SIZE
)


@tf.function
def eval_step(images, labels):
    predictions = new_model(images, training=False)
    eval_accuracy(labels, predictions)


checkpoint = tf.train.Checkpoint(optimizer=new_optimizer, model=new_model)
checkpoint.restore(tf.train.latest_checkpoint(checkpoint_dir))

for images, labels in test_dataset:
    eval_step(images, labels)

print(f"Accuracy of the restored model, without a strategy: {eval_accuracy.result() * 100}")
restored_accuracy = eval_accuracy.result() * 100
latest_checkpoint = os.path.basename(tf.train.latest_checkpoint(checkpoint_dir))

# -- Training on with an explicit iterator, a fixed number of steps per epoch
iterator_loop = []  # (report)

for _ in range(EPOCHS):
    total_loss = 0.0
    num_batches = 0
    train_iter = iter(train_dist_dataset)
    for _ in range(steps(10)):
        total_loss += distributed_train_step(next(train_iter))
        num_batches += 1
    average_train_loss = total_loss / num_batches

    # (`epoch` is the last one of the first loop: the tutorial prints it so too)
    print(
        f"Epoch {epoch + 1}, Loss: {average_train_loss}, Accuracy: {train_accuracy.result() * 100}"
    )
    iterator_loop.append([average_train_loss, train_accuracy.result() * 100])
    train_accuracy.reset_states()


# -- Training on with a whole epoch in one tf.function
@tf.function
def distributed_train_epoch(dataset):
    total_loss = 0.0
    num_batches = 0
    for x in dataset:
        per_replica_losses = strategy.run(train_step, args=(x,))
        total_loss += strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)
        num_batches += 1
    return total_loss / tf.cast(num_batches, dtype=tf.float32)


function_loop = []  # (report)

for epoch in range(EPOCHS):
    train_loss = distributed_train_epoch(train_dist_dataset)
    print(f"Epoch {epoch + 1}, Loss: {train_loss}, Accuracy: {train_accuracy.result() * 100}")
    function_loop.append([train_loss, train_accuracy.result() * 100])
    train_accuracy.reset_states()

report(
    {
        "global_batch_size": GLOBAL_BATCH_SIZE,
        "epochs_loss_acc_testloss_testacc": first_loop,
        "weights_after_first_loop": weights_after_first_loop,
        "checkpoint_files": checkpoint_files,
        "latest_checkpoint": latest_checkpoint,
        "restored_without_strategy_accuracy": restored_accuracy,
        "restored_weights": checksum(new_model.get_weights()),
        "iterator_loop_loss_acc": iterator_loop,
        "tf_function_loop_loss_acc": function_loop,
        "weights": checksum(model.get_weights()),
    }
)
