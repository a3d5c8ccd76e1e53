"""Follows tensorflow/docs site/en/guide/checkpoint.ipynb ("Training
checkpoints"), call for call, under a strategy as a tf.distribute user would.

A subclassed linear model (``Net``) and ``Model.save_weights`` of a TensorFlow
checkpoint; the toy dataset, the train step, a ``tf.train.Checkpoint`` of the
step, the optimizer, the model and the dataset's iterator, and a
``tf.train.CheckpointManager(max_to_keep=3)``; ``train_and_checkpoint`` (restore
the latest checkpoint, 50 steps, a save every 10) run twice, the second time
with a new model, optimizer, iterator, checkpoint and manager that pick up where
the first left off; ``manager.checkpoints`` and the directory's files; then the
loading mechanics: a partial restore of the bias through stand-in
``tf.train.Checkpoint`` objects with ``assert_existing_objects_matched``, the
delayed restoration of the kernel, ``tf.train.list_variables``, and list and
dict tracking (``save.listed`` / ``save.mapped`` saved and restored in part).

Adapted (see _tutorial.py): the strategy line; the model and the optimizers
created in ``strategy.scope()`` and each step run by ``strategy.run`` in a ``tf.function`` with
the loss reduced by ``strategy.reduce(MEAN)`` (the guide has no strategy: this
is how a tf.distribute user runs its step). The checkpointed iterator stays the
guide's iterator of the dataset, whose batch every replica trains on: an
iterator of a distributed dataset cannot go into a ``tf.train.Checkpoint``
under MirroredStrategy either (ValueError: not trackable). The section on
Estimator checkpoints is left out (``tf.estimator`` is gone from TensorFlow
2.16 on). All 50 steps of each run are kept (with fewer, no checkpoint would be
saved). Run with the working directory as argv[1] and as the current directory.
"""

from _tutorial import begin, checksum, make_strategy, report

begin(keras="tf_keras")  # save_weights to a TensorFlow checkpoint (no .weights.h5)

import os

import tensorflow as tf

strategy = make_strategy()


class Net(tf.keras.Model):
    """A simple linear model."""

    def __init__(self):
        super().__init__()
        self.l1 = tf.keras.layers.Dense(5)

    def call(self, x):
        return self.l1(x)


with strategy.scope():
    net = Net()

# -- Saving from tf.keras training APIs
net.save_weights("easy_checkpoint")


# -- Manual checkpointing: the toy dataset and the step
def toy_dataset():
    inputs = tf.range(10.0)[:, None]
    labels = inputs * 5.0 + tf.range(5.0)[None, :]
    return tf.data.Dataset.from_tensor_slices(dict(x=inputs, y=labels)).repeat().batch(2)


def train_step(net, example, optimizer):
    """Trains `net` on `example` using `optimizer`."""
    with tf.GradientTape() as tape:
        output = net(example["x"])
        loss = tf.reduce_mean(tf.abs(output - example["y"]))
    variables = net.trainable_variables
    gradients = tape.gradient(loss, variables)
    optimizer.apply_gradients(zip(gradients, variables))
    return loss


def distributed_train_step(net, example, optimizer):  # (the strategy's step)
    per_replica_losses = strategy.run(train_step, args=(net, example, optimizer))
    return strategy.reduce(tf.distribute.ReduceOp.MEAN, per_replica_losses, axis=None)


# -- The checkpoint objects
with strategy.scope():
    opt = tf.keras.optimizers.Adam(0.1)
dataset = toy_dataset()
iterator = iter(dataset)
ckpt = tf.train.Checkpoint(step=tf.Variable(1), optimizer=opt, net=net, iterator=iterator)
manager = tf.train.CheckpointManager(ckpt, "./tf_ckpts", max_to_keep=3)

printed = []  # (report) what train_and_checkpoint printed


def train_and_checkpoint(net, manager):
    ckpt.restore(manager.latest_checkpoint)
    if manager.latest_checkpoint:
        print(f"Restored from {manager.latest_checkpoint}")
        printed.append(["restored", manager.latest_checkpoint])
    else:
        print("Initializing from scratch.")
        printed.append(["from scratch"])

    step = tf.function(distributed_train_step)  # (one per model: its variables in the first trace)
    for _ in range(50):
        example = next(iterator)
        loss = step(net, example, opt)
        ckpt.step.assign_add(1)
        if int(ckpt.step) % 10 == 0:
            save_path = manager.save()
            print(f"Saved checkpoint for step {int(ckpt.step)}: {save_path}")
            print(f"loss {loss.numpy():1.2f}")
            printed.append([int(ckpt.step), save_path, float(loss.numpy())])


# -- Train and checkpoint the model
train_and_checkpoint(net, manager)
first_weights = checksum(net.get_weights())

# -- Restore and continue training
with strategy.scope():
    opt = tf.keras.optimizers.Adam(0.1)
    net = Net()
dataset = toy_dataset()
iterator = iter(dataset)
ckpt = tf.train.Checkpoint(step=tf.Variable(1), optimizer=opt, net=net, iterator=iterator)
manager = tf.train.CheckpointManager(ckpt, "./tf_ckpts", max_to_keep=3)

train_and_checkpoint(net, manager)

print(manager.checkpoints)  # List the three remaining checkpoints
checkpoint_files = sorted(os.listdir("./tf_ckpts"))  # the guide's `!ls ./tf_ckpts`

# -- Loading mechanics: the bias alone
to_restore = tf.Variable(tf.zeros([5]))
print(to_restore.numpy())  # All zeros
fake_layer = tf.train.Checkpoint(bias=to_restore)
fake_net = tf.train.Checkpoint(l1=fake_layer)
new_root = tf.train.Checkpoint(net=fake_net)
status = new_root.restore(tf.train.latest_checkpoint("./tf_ckpts/"))
print(to_restore.numpy())  # We get the restored value now

status.assert_existing_objects_matched()

# -- Delayed restorations
delayed_restore = tf.Variable(tf.zeros([1, 5]))
print(delayed_restore.numpy())  # Not restored; still zeros
fake_layer.kernel = delayed_restore
print(delayed_restore.numpy())  # Restored

# -- Manually inspecting checkpoints
listed_variables = tf.train.list_variables(tf.train.latest_checkpoint("./tf_ckpts/"))

# -- List and dictionary tracking
save = tf.train.Checkpoint()
save.listed = [tf.Variable(1.0)]
save.listed.append(tf.Variable(2.0))
save.mapped = {"one": save.listed[0]}
save.mapped["two"] = save.listed[1]
save_path = save.save("./tf_list_example")

restore = tf.train.Checkpoint()
v2 = tf.Variable(0.0)
assert v2.numpy() == 0.0  # Not restored yet
restore.mapped = {"two": v2}
restore.restore(save_path)
assert v2.numpy() == 2.0

restore.listed = []
print(restore.listed)  # ListWrapper([])
v1 = tf.Variable(0.0)
restore.listed.append(v1)  # Restores v1, from restore() in the previous cell
assert v1.numpy() == 1.0

report(
    {
        "printed": printed,
        "weights_after_first_run": first_weights,
        "weights": checksum(net.get_weights()),
        "optimizer_iterations": int(opt.iterations.numpy()),
        "step": int(ckpt.step.numpy()),
        "manager_checkpoints": manager.checkpoints,
        "checkpoint_files": checkpoint_files,
        "restored_bias": to_restore.numpy(),
        "restored_kernel": delayed_restore.numpy(),
        # (an iterator's saved state holds the elements its injected prefetch
        # had buffered: how many is timing, under any strategy)
        "list_variables": [
            [name] if "ITERATOR_STATE" in name else [name, list(shape)]
            for name, shape in listed_variables
        ],
        "list_example": [save_path, float(v1.numpy()), float(v2.numpy())],
        "easy_checkpoint_files": sorted(f for f in os.listdir(".") if "easy_checkpoint" in f),
    }
)
