"""Follows tensorflow/docs site/en/tutorials/distribute/multi_worker_with_keras.ipynb
("Multi-worker training with Keras"), call for call.

Its mnist_setup module (mnist_setup.py here); a fit of the model on one
worker without a strategy; the strategy and the model built in its scope;
the tutorial's main.py (run by every worker: global batch =
per_worker_batch_size * number of workers from TF_CONFIG, the strategy, the
dataset, the model in scope, Model.fit with steps_per_epoch); a dataset with
AutoShardPolicy.OFF; Model.save of the multi-worker model to the chief's path
or a per-worker temporary directory (``_is_chief`` / ``write_filepath`` from
strategy.cluster_resolver's task_type and task_id, as written there), removal
of the temporary copy, load_model of the chief's copy and fit; a
tf.train.Checkpoint with a CheckpointManager (max_to_keep=1) written the same
way, tf.train.latest_checkpoint, Checkpoint.restore and fit; three fits with
the BackupAndRestore callback (default, per epoch, every save_freq steps),
each of a model built in scope.

Adapted (see _tutorial.py): the strategy lines; local MNIST; TF_CONFIG as
the launcher would set it (the MPI job, or the two workers that
MirroredStrategy's replicas stand for); steps_per_epoch and save_freq cut
with ``steps`` (the epochs are the tutorial's); the tutorial's /tmp paths
are under ./tmp in the working directory. main.py runs in this process, as
a function, where the tutorial starts it with TF_CONFIG in worker
subprocesses; the notebook's environment set-up (CUDA_VISIBLE_DEVICES,
pip, %%bash, subprocess logs) has no counterpart here.
Run with the working directory as argv[1] and as the current directory.
"""

from _tutorial import TF_CONFIG, begin, checksum, history, make_strategy, report, steps

begin(keras="tf_keras")  # Model.save / load_model of a SavedModel directory (see _tutorial.py)

import json
import os

import tensorflow as tf

import mnist_setup

numbers = {}  # (report)

# -- Model training on a single worker
batch_size = 64
single_worker_dataset = mnist_setup.mnist_dataset(batch_size)
single_worker_model = mnist_setup.build_and_compile_cnn_model()
numbers["single_worker_fit"] = history(
    single_worker_model.fit(single_worker_dataset, epochs=3, steps_per_epoch=steps(70))
)

# -- Multi-worker configuration
tf_config = {
    "cluster": {"worker": ["localhost:12345", "localhost:23456"]},
    "task": {"type": "worker", "index": 0},
}
json.dumps(tf_config)

# -- Train the model
strategy = make_strategy()

with strategy.scope():
    multi_worker_model = mnist_setup.build_and_compile_cnn_model()


def main_py():
    """main.py, which every worker runs."""
    per_worker_batch_size = 64
    tf_config = json.loads(TF_CONFIG)  # os.environ['TF_CONFIG']
    num_workers = len(tf_config["cluster"]["worker"])

    strategy = make_strategy()

    global_batch_size = per_worker_batch_size * num_workers
    multi_worker_dataset = mnist_setup.mnist_dataset(global_batch_size)

    with strategy.scope():
        multi_worker_model = mnist_setup.build_and_compile_cnn_model()

    fitted = multi_worker_model.fit(multi_worker_dataset, epochs=3, steps_per_epoch=steps(70))
    numbers["main_py_global_batch_size"] = global_batch_size
    numbers["main_py_fit"] = history(fitted)
    numbers["main_py_weights"] = checksum(multi_worker_model.get_weights())


main_py()

# -- Dataset sharding
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF

global_batch_size = 64
multi_worker_dataset = mnist_setup.mnist_dataset(batch_size=64)
dataset_no_auto_shard = multi_worker_dataset.with_options(options)

# -- Model saving and loading
model_path = "tmp/keras-model"


def _is_chief(task_type, task_id):
    return (task_type == "worker" and task_id == 0) or task_type is None


def _get_temp_dir(dirpath, task_id):
    base_dirpath = "workertemp_" + str(task_id)
    temp_dir = os.path.join(dirpath, base_dirpath)
    tf.io.gfile.makedirs(temp_dir)
    return temp_dir


def write_filepath(filepath, task_type, task_id):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not _is_chief(task_type, task_id):
        dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)


task_type, task_id = (strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id)
write_model_path = write_filepath(model_path, task_type, task_id)

multi_worker_model.save(write_model_path)

if not _is_chief(task_type, task_id):
    tf.io.gfile.rmtree(os.path.dirname(write_model_path))

loaded_model = tf.keras.models.load_model(model_path)
numbers["loaded_model_weights"] = checksum(loaded_model.get_weights())

numbers["loaded_model_fit"] = history(
    loaded_model.fit(single_worker_dataset, epochs=2, steps_per_epoch=steps(20))
)

# -- Checkpoint saving and restoring
checkpoint_dir = "tmp/ckpt"

checkpoint = tf.train.Checkpoint(model=multi_worker_model)
write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id)
checkpoint_manager = tf.train.CheckpointManager(
    checkpoint, directory=write_checkpoint_dir, max_to_keep=1
)

checkpoint_manager.save()
if not _is_chief(task_type, task_id):
    tf.io.gfile.rmtree(write_checkpoint_dir)

latest_checkpoint = tf.train.latest_checkpoint(checkpoint_dir)
checkpoint.restore(latest_checkpoint)
numbers["latest_checkpoint"] = os.path.basename(latest_checkpoint) if latest_checkpoint else None
numbers["restored_fit"] = history(
    multi_worker_model.fit(multi_worker_dataset, epochs=2, steps_per_epoch=steps(20))
)
numbers["restored_weights"] = checksum(multi_worker_model.get_weights())

# -- The BackupAndRestore callback: backs up at epoch ends by default ...
callbacks = [tf.keras.callbacks.BackupAndRestore(backup_dir="tmp/backup")]
with strategy.scope():
    multi_worker_model = mnist_setup.build_and_compile_cnn_model()
numbers["backup_default_fit"] = history(
    multi_worker_model.fit(
        multi_worker_dataset, epochs=3, steps_per_epoch=steps(70), callbacks=callbacks
    )
)

# ... the tutorial's "save_freq='epoch'" cell (which passes no save_freq either) ...
callbacks = [tf.keras.callbacks.BackupAndRestore(backup_dir="tmp/backup")]
with strategy.scope():
    multi_worker_model = mnist_setup.build_and_compile_cnn_model()
numbers["backup_epoch_fit"] = history(
    multi_worker_model.fit(
        multi_worker_dataset, epochs=3, steps_per_epoch=steps(70), callbacks=callbacks
    )
)

# ... and every save_freq steps.
callbacks = [tf.keras.callbacks.BackupAndRestore(backup_dir="tmp/backup", save_freq=steps(30))]
with strategy.scope():
    multi_worker_model = mnist_setup.build_and_compile_cnn_model()
numbers["backup_steps_fit"] = history(
    multi_worker_model.fit(
        multi_worker_dataset, epochs=3, steps_per_epoch=steps(70), callbacks=callbacks
    )
)
numbers["backup_steps_weights"] = checksum(multi_worker_model.get_weights())

numbers["backup_dir_left"] = os.path.exists("tmp/backup") and sorted(os.listdir("tmp/backup"))
report(numbers)
