"""Kill one rank mid-training, relaunch: training resumes and loses nothing.

A 2-rank job is killed (SIGKILL of rank 1, at a step chosen at random by the
test and printed) and relaunched with the same command. The relaunched job
resumes from the last checkpoint and ends with exactly the weights of a run
that was never interrupted. Two ways of resuming are checked:

* a custom loop with ``tf.train.CheckpointManager`` (saved on every rank,
  written by rank 0, restored by every rank). The input position is not
  checkpointed: the pipeline is a function of the global step
  (``skip(step * global_batch)`` of one fixed stream, then shard), so it
  resumes at the right example at any world size;
* Keras 3 ``fit`` with ``BackupAndRestore(save_freq="epoch")``, which resumes
  at the start of the epoch in which the job died, from the weights and
  optimizer state of the end of the previous epoch (the input restarts with
  the epoch). Keras 3.15 cannot resume mid-epoch: with ``save_freq=<steps>``
  it records the batch but restarts that epoch from batch 0 with mid-epoch
  weights, training on some batches twice. The kill lands mid-epoch, never on
  an epoch's last batch: rank 0 may then be rewriting the backup in place
  when rank 1 dies, and a torn backup is Keras' problem, not this test's.

Both killed launches also show that a SIGKILLed rank ends the whole job
promptly (MPICH's launcher kills the other ranks).

Three launches: [custom killed], [custom resumed, custom uninterrupted, Keras
killed], [Keras resumed, Keras uninterrupted]. The uninterrupted reference runs
in the same kind of 2-rank job; weights must agree within 1e-6.
"""

import os
import random
import re
import sys
import time

import numpy as np
import pytest

from mpi_strategy._src.core.launch import is_open_mpi, run_mpiexec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Custom loop: STEPS steps, a checkpoint every CKPT_EVERY steps.
STEPS, CKPT_EVERY = 12, 3
# Keras: EPOCHS epochs of BATCHES_PER_EPOCH batches.
EPOCHS, BATCHES_PER_EPOCH = 4, 5
KILL_DEADLINE = 30.0  # seconds from the kill to the end of the job

JOB = r"""
import json, os, signal, sys, time
import numpy as np
import tensorflow as tf
import mpi_strategy
from mpi4py import MPI

tf.config.threading.set_intra_op_parallelism_threads(1)  # bitwise-reproducible runs
STEPS, CKPT_EVERY, EPOCHS, BATCHES_PER_EPOCH = (int(a) for a in sys.argv[2:6])
WORKDIR = sys.argv[1]
GLOBAL_BATCH = 8
strategy = mpi_strategy.MPIStrategy()
rank = MPI.COMM_WORLD.Get_rank()


def report(**fields):
    print("REPORT " + json.dumps(dict(rank=rank, **fields)), flush=True)


def kill_myself(step):
    report(event="kill", step=step, time=time.time())
    time.sleep(0.2)  # lets the launcher forward the line above
    os.kill(os.getpid(), signal.SIGKILL)


def deterministic_weights(model):
    model.set_weights([np.sin(np.arange(w.size) * 0.7 + 1.0).reshape(w.shape).astype(np.float32)
                       * 0.4 for w in model.get_weights()])


def examples(start_step):
    # One fixed stream of examples; resuming at `start_step` skips what the
    # first `start_step` global batches consumed, then shards by rank.
    n = STEPS * GLOBAL_BATCH
    ds = tf.data.Dataset.range(n).skip(start_step * GLOBAL_BATCH)
    ds = ds.map(lambda i: (tf.stack([tf.sin(tf.cast(i, tf.float32)),
                                     tf.cos(tf.cast(i, tf.float32) * 0.3), 1.0]),
                           tf.cast(i % 5, tf.float32) * 0.2))
    return strategy.experimental_distribute_dataset(ds.batch(GLOBAL_BATCH))


def custom(ckpt_dir, kill_step):
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(4, "tanh"),
                                     tf.keras.layers.Dense(1)])
        deterministic_weights(model)
        optimizer = tf.keras.optimizers.Adam(0.05)
        optimizer.build(model.trainable_variables)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    latest = tf.train.latest_checkpoint(ckpt_dir)
    if latest:  # every rank restores
        checkpoint.restore(latest).assert_existing_objects_matched()
    start = int(optimizer.iterations.numpy())
    report(event="start", variant="custom", start_step=start)

    @tf.function
    def train_step(batch):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum((model(x)[:, 0] - y) ** 2) / GLOBAL_BATCH
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                          model.trainable_variables))
        strategy.run(replica_step, args=batch)

    for step, batch in enumerate(examples(start), start=start + 1):
        train_step(batch)
        if step % CKPT_EVERY == 0:  # every rank saves, rank 0 writes
            tf.train.CheckpointManager(checkpoint, ckpt_dir, max_to_keep=2).save(
                checkpoint_number=step)
        if rank == 1 and step == kill_step:
            kill_myself(step)
    return model


def keras(backup_dir, kill_step):
    import keras
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                                  keras.layers.Dense(1)])
        deterministic_weights(model)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    n = BATCHES_PER_EPOCH * GLOBAL_BATCH  # the same examples every epoch
    i = np.arange(n, dtype=np.float32)
    x = np.stack([np.sin(i), np.cos(i * 0.3), np.ones_like(i)], axis=1)
    y = (np.arange(n) % 5 * 0.2).astype(np.float32)

    class KillAt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if rank == 1 and self.epoch * BATCHES_PER_EPOCH + batch + 1 == kill_step:
                kill_myself(kill_step)

    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=[keras.callbacks.BackupAndRestore(backup_dir), KillAt()])
    report(event="fitted", variant="keras", epochs_run=len(history.history["loss"]))
    return model


# Each further argument is one run: variant:directory:kill_step (0: no kill).
for run in sys.argv[6:]:
    variant, name, kill_step = run.split(":")
    model = {"custom": custom, "keras": keras}[variant](
        os.path.join(WORKDIR, f"{variant}-{name}"), int(kill_step))
    if rank == 0:
        np.savez(os.path.join(WORKDIR, f"{variant}-{name}.npz"), *model.get_weights())
    report(event="done", variant=variant, name=name)
"""


def _reports(out):
    import json
    # Rank tags and other ranks' output may split or join lines.
    plain = re.sub(r"\[\d+\] ?", "", out)
    return [json.loads(m) for m in re.findall(r"REPORT (\{[^{}]*\})", plain)]


def _launch(workdir, runs, expect_kill):
    argv = [sys.executable, str(workdir / "job.py"), str(workdir),
            str(STEPS), str(CKPT_EVERY), str(EPOCHS), str(BATCHES_PER_EPOCH), *runs]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    started = time.time()
    code, out = run_mpiexec(2, argv, timeout=180, env=env)
    ended = time.time()
    print(f"launch {runs}: {ended - started:.1f} s")
    reports = _reports(out)
    if not expect_kill:
        assert code == 0, out[-5000:]
        return reports, out
    kills = [r for r in reports if r["event"] == "kill"]
    assert code != 0 and len(kills) == 1, out[-5000:]
    took = ended - kills[0]["time"]
    # A rank killed by a signal ends the job: MPICH's hydra kills the other
    # ranks, which were waiting for it in the next collective.
    assert took < KILL_DEADLINE, f"the job took {took:.1f} s to end after the kill:\n{out[-5000:]}"
    if not is_open_mpi():  # what MPICH's hydra prints
        plain = re.sub(r"\[\d+\] ?", "", out)
        assert "BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES" in plain, out[-3000:]
        assert "Killed (signal 9)" in plain, out[-3000:]
    return reports, out


def _weights(path):
    with np.load(path) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


def _assert_same_weights(got, want, what):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-6, err_msg=what)


@pytest.mark.single_process
def test_killed_jobs_resume_to_the_uninterrupted_weights(tmp_path):
    seed = int(os.environ.get("MPI_STRATEGY_TEST_SEED", random.randrange(10**6)))
    rng = random.Random(seed)
    custom_kill = rng.randint(1, STEPS - 1)
    # Keras: mid-epoch, never on an epoch's last batch (see the module docstring).
    epoch, batch = rng.randrange(EPOCHS), rng.randrange(BATCHES_PER_EPOCH - 1)
    keras_kill = epoch * BATCHES_PER_EPOCH + batch + 1
    what = (f"seed {seed}: custom loop killed after step {custom_kill}, "
            f"Keras after step {keras_kill}")
    print(what)
    (tmp_path / "job.py").write_text(JOB)

    _launch(tmp_path, [f"custom:run:{custom_kill}"], expect_kill=True)
    reports, out = _launch(tmp_path, ["custom:run:0", "custom:reference:0",
                                      f"keras:run:{keras_kill}"], expect_kill=True)
    starts = [r for r in reports if r["event"] == "start" and r["variant"] == "custom"]
    resumed_at = (custom_kill // CKPT_EVERY) * CKPT_EVERY
    for rank in (0, 1):  # the resumed run, then the uninterrupted one
        assert [r["start_step"] for r in starts if r["rank"] == rank] == [resumed_at, 0], (
            what, out[-5000:])
    _assert_same_weights(_weights(tmp_path / "custom-run.npz"),
                         _weights(tmp_path / "custom-reference.npz"), what)

    reports, out = _launch(tmp_path, ["keras:run:0", "keras:reference:0"], expect_kill=False)
    epochs_run = [r["epochs_run"] for r in reports if r["event"] == "fitted" and r["rank"] == 0]
    # Resumed at the start of the epoch in which the kill landed.
    assert epochs_run == [EPOCHS - epoch, EPOCHS], (what, out[-5000:])
    _assert_same_weights(_weights(tmp_path / "keras-run.npz"),
                         _weights(tmp_path / "keras-reference.npz"), what)
