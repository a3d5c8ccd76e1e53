"""mpi_strategy.saving and checkpoints: rank 0 writes, every rank restores."""

import os

import numpy as np
import pytest
import tensorflow as tf

import mpi_strategy
from mpi_testing import RANK, WORLD, assert_same_on_all_ranks




def make_model(strategy, seed):
    tf.random.set_seed(seed)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(2)])
        optimizer = tf.keras.optimizers.Adam(0.1)
        optimizer.build(model.trainable_variables)

    @tf.function
    def train_step():
        def replica_step():
            x = tf.ones([2, 3]) * tf.cast(
                tf.distribute.get_replica_context().replica_id_in_sync_group + 1, tf.float32)
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(x) ** 2) / 10.0
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(replica_step)

    return model, optimizer, train_step


def test_rank0_writes_checkpoint_every_rank_restores_and_continues(strategy, shared_dir):
    model, optimizer, train_step = make_model(strategy, seed=1)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    directory = os.path.join(shared_dir, "ckpt")
    for _ in range(2):
        train_step()
    if strategy.extended.should_checkpoint:
        # Model and optimizer hold no metric: rank 0 alone may save.
        tf.train.CheckpointManager(checkpoint, directory, max_to_keep=2).save()
    WORLD.Barrier()
    for _ in range(2):
        train_step()
    expected = model.get_weights()

    fresh, fresh_optimizer, fresh_step = make_model(strategy, seed=2)
    assert not np.allclose(fresh.get_weights()[0], expected[0])
    restore = tf.train.Checkpoint(model=fresh, optimizer=fresh_optimizer)
    restore.restore(tf.train.latest_checkpoint(directory)).assert_existing_objects_matched()
    for _ in range(2):
        fresh_step()
    for got, want in zip(fresh.get_weights(), expected):
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert_same_on_all_ranks(got, "restored weight")
    assert os.listdir(directory) if RANK == 0 else True


def test_checkpoint_holding_metrics_is_saved_by_every_rank(strategy, shared_dir):
    with strategy.scope():  # how metrics keep their state
        total = tf.Variable(0.0, synchronization=tf.VariableSynchronization.ON_READ,
                            aggregation=tf.VariableAggregation.SUM)
    strategy.run(lambda: total.assign_add(1.0))
    checkpoint = tf.train.Checkpoint(total=total)
    directory = os.path.join(shared_dir, "with-metric")
    # Saving reads the metric, which is a collective: every rank saves.
    with mpi_strategy.only_chief_writes(directory) as where:
        tf.train.CheckpointManager(checkpoint, where, max_to_keep=1).save()
    assert sorted(os.listdir(shared_dir)) == ["with-metric"]
    assert tf.train.latest_checkpoint(directory) is not None


def test_only_chief_writes_scratch_is_removed(shared_dir):
    target = os.path.join(shared_dir, "file.txt")
    with mpi_strategy.only_chief_writes(target) as where:
        with open(where, "w") as f:
            f.write(str(RANK))
        scratch = os.path.dirname(where)
    with open(target) as f:
        assert f.read() == "0"  # every rank sees rank 0's file after the block
    if RANK != 0:
        assert not os.path.exists(scratch)


KEEP_SAVING = r"""
import sys, time
import numpy as np
import tensorflow as tf
variable = tf.Variable(np.zeros([4_000_000], np.float32))  # 16 MB per checkpoint
manager = tf.train.CheckpointManager(tf.train.Checkpoint(v=variable), sys.argv[1], max_to_keep=2)
step = 0
while True:
    step += 1
    variable.assign(tf.fill([4_000_000], float(step)))
    manager.save(checkpoint_number=step)
    print(step, flush=True)
"""


@pytest.mark.single_process
def test_a_kill_during_checkpoint_writes_leaves_the_latest_checkpoint_usable(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    def writing(directory):  # a "<name>_temp" directory: a save in progress
        return any(name.endswith("_temp") for name in os.listdir(directory))

    killed_mid_write = 0
    for attempt in range(6):
        directory = str(tmp_path / f"ckpt{attempt}")
        child = subprocess.Popen([sys.executable, "-c", KEEP_SAVING, directory],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert child.stdout.readline().strip() == "1"
        # Kill as soon as a save is seen in progress (not after a fixed sleep,
        # which on a loaded machine too often lands between two saves).
        deadline = time.monotonic() + 20
        while not writing(directory) and time.monotonic() < deadline:
            time.sleep(0.0005)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        killed_mid_write += writing(directory)  # the kill interrupted that save

        latest = tf.train.latest_checkpoint(directory)
        number = int(latest.rsplit("-", 1)[1])
        restored = tf.Variable(np.zeros([4_000_000], np.float32))
        tf.train.Checkpoint(v=restored).restore(latest).assert_existing_objects_matched()
        np.testing.assert_array_equal(restored.numpy()[[0, -1]], [number, number])
        if killed_mid_write:
            break
    assert killed_mid_write, "no kill landed inside a checkpoint write in 6 attempts"
