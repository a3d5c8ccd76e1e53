"""Run by tests/launchers/features/saving/test_resume.py (2 ranks) and test_preemption.py (2, 3):
``python resume_job.py WORKDIR STEPS CKPT_EVERY EPOCHS BATCHES_PER_EPOCH RUN...``.

Each RUN is ``variant:name:kill_step`` (variant ``custom`` or ``keras``;
kill_step 0: no kill): a custom loop with a CheckpointManager, or Keras fit
with BackupAndRestore, in WORKDIR/variant-name, where rank 1 SIGKILLs itself
after step kill_step. Variant ``handler`` (tests/launchers/features/test_preemption.py):
the custom loop under TensorFlow's PreemptionCheckpointHandler, with a
preemption notice instead of kill_step (see ``preempted``); variants
``tfkeras`` (tf_keras fit with ``BackupAndRestore(save_before_preemption=True)``)
and ``keras3`` (Keras 3 fit with ``BackupAndRestore(save_freq=CKPT_EVERY)``)
take the same notice after a global step of fit (see ``backed_up``).
Each rank prints REPORT lines (JSON) and rank 0 saves the final weights.
Relaunched, a killed run resumes; the test shows that it ends with the
weights of an uninterrupted run.
"""

import atexit
import json
import os
import signal
import sys
import threading
import time

import numpy as np
import tensorflow as tf
from mpi4py import MPI

import mpi_strategy

tf.config.threading.set_intra_op_parallelism_threads(1)  # bitwise-reproducible runs
STEPS, CKPT_EVERY, EPOCHS, BATCHES_PER_EPOCH = (int(a) for a in sys.argv[2:6])
WORKDIR = sys.argv[1]
GLOBAL_BATCH = 8
# RESUME_JOB_SHARD: MPIStrategy's shard= (the checkpoints are then written in parts).
strategy = mpi_strategy.MPIStrategy(shard=os.environ.get("RESUME_JOB_SHARD") or None)
rank = MPI.COMM_WORLD.Get_rank()


def report(**fields):
    print("REPORT " + json.dumps(dict(rank=rank, **fields)), flush=True)


def kill_myself(step):
    report(event="kill", step=step, time=time.time())
    time.sleep(0.2)  # lets the launcher forward the line above
    os.kill(os.getpid(), signal.SIGKILL)


def deterministic_weights(model):
    model.set_weights(
        [
            np.sin(np.arange(w.size) * 0.7 + 1.0).reshape(w.shape).astype(np.float32) * 0.4
            for w in model.get_weights()
        ]
    )


def examples(start_step):
    # One fixed stream of examples; resuming at `start_step` skips what the
    # first `start_step` global batches consumed, then shards by rank.
    n = STEPS * GLOBAL_BATCH
    ds = tf.data.Dataset.range(n).skip(start_step * GLOBAL_BATCH)
    ds = ds.map(
        lambda i: (
            tf.stack([tf.sin(tf.cast(i, tf.float32)), tf.cos(tf.cast(i, tf.float32) * 0.3), 1.0]),
            tf.cast(i % 5, tf.float32) * 0.2,
        )
    )
    return strategy.experimental_distribute_dataset(ds.batch(GLOBAL_BATCH))


def trainer():
    """A model, its optimizer and a distributed training step, the same in every
    run. (64 units: sharded over 3 ranks, every rank holds a share and two
    variables are cut in rows.)"""
    with strategy.scope():
        model = tf.keras.Sequential(
            [tf.keras.Input((3,)), tf.keras.layers.Dense(64, "tanh"), tf.keras.layers.Dense(1)]
        )
        deterministic_weights(model)
        optimizer = tf.keras.optimizers.Adam(0.05)
        optimizer.build(model.trainable_variables)

    @tf.function
    def train_step(batch):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum((model(x)[:, 0] - y) ** 2) / GLOBAL_BATCH
            optimizer.apply_gradients(
                zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            )

        strategy.run(replica_step, args=batch)

    return model, optimizer, train_step


def custom(ckpt_dir, kill_step):
    model, optimizer, train_step = trainer()
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    latest = tf.train.latest_checkpoint(ckpt_dir)
    if latest:  # every rank restores
        checkpoint.restore(latest).assert_existing_objects_matched()
    start = int(optimizer.iterations.numpy())
    report(event="start", variant="custom", start_step=start)

    for step, batch in enumerate(examples(start), start=start + 1):
        train_step(batch)
        if step % CKPT_EVERY == 0:  # every rank saves, rank 0 writes
            tf.train.CheckpointManager(checkpoint, ckpt_dir, max_to_keep=2).save(
                checkpoint_number=step
            )
        if rank == 1 and step == kill_step:
            kill_myself(step)
    return model


def preempted(ckpt_dir, notice):
    """TensorFlow's PreemptionCheckpointHandler around the custom loop. ``notice``:
    "0" (none) or "SIGNAL/RANKS/STEP[/stall]": each of RANKS ("0+last": rank 0
    and the last one) sends itself SIGNAL after step STEP (SIGUSR1: a signal the program watches
    through TerminationConfig.termination_watcher_fn); "stall": the last rank
    then stops before the next step (until the test kills the job)."""
    model, optimizer, train_step = trainer()
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    manager = tf.train.CheckpointManager(checkpoint, ckpt_dir, max_to_keep=2)
    fields = notice.split("/") if notice != "0" else ["", "-1", "0"]
    signame, notice_rank, notice_step = fields[:3]
    stall = fields[3:] == ["stall"]
    size = MPI.COMM_WORLD.Get_size()
    noticing = {size - 1 if r == "last" else int(r) for r in notice_rank.split("+")}
    watched = threading.Event()
    config = None
    if signame == "SIGUSR1":
        signal.signal(signal.SIGUSR1, lambda signum, frame: watched.set())
        config = tf.distribute.experimental.TerminationConfig(termination_watcher_fn=watched.is_set)
    with strategy.scope():
        handler = tf.distribute.experimental.PreemptionCheckpointHandler(
            strategy.cluster_resolver, manager, termination_config=config
        )
    start = int(optimizer.iterations.numpy())  # restored by the handler
    name = os.path.basename(ckpt_dir)
    report(event="start", variant="handler", run=name, start_step=start, pid=os.getpid())
    atexit.register(lambda: report(event="exit", run=name, steps=int(optimizer.iterations.numpy())))
    for step, batch in enumerate(examples(start), start=start + 1):
        handler.run(train_step, batch)
        if step % CKPT_EVERY == 0:
            manager.save()
        if step == int(notice_step) and rank in noticing:
            report(event="notice", step=step, signal=signame)
            os.kill(os.getpid(), getattr(signal, signame))
            if signame == "SIGUSR1":  # (before the next step, for a known step to save at)
                handler._received_own_sigterm.wait()
        if step == int(notice_step) and stall and rank == size - 1:
            report(event="stalled", step=step)
            time.sleep(3600)
    return model


def keras(backup_dir, kill_step):
    import keras

    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)]
        )
        deterministic_weights(model)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    n = BATCHES_PER_EPOCH * GLOBAL_BATCH  # the same examples every epoch
    i = np.arange(n, dtype=np.float32)
    x = np.stack([np.sin(i), np.cos(i * 0.3), np.ones_like(i)], axis=1)
    y = (np.arange(n) % 5 * 0.2).astype(np.float32)

    class KillAt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = int(epoch)

        def on_train_batch_end(self, batch, logs=None):
            if rank == 1 and self.epoch * BATCHES_PER_EPOCH + batch + 1 == kill_step:
                kill_myself(kill_step)

    history = model.fit(
        x,
        y,
        batch_size=GLOBAL_BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(backup_dir), KillAt()],
    )
    report(event="fitted", variant="keras", epochs_run=len(history.history["loss"]))
    return model


def _noticing(notice):
    """(signal name, the ranks that send it, the global step after which) of a notice."""
    signame, ranks, step = (notice.split("/") if notice != "0" else ["", "-1", "0"])[:3]
    size = MPI.COMM_WORLD.Get_size()
    return signame, {size - 1 if r == "last" else int(r) for r in ranks.split("+")}, int(step)


def _examples():
    n = BATCHES_PER_EPOCH * GLOBAL_BATCH  # the same examples every epoch, in order
    i = np.arange(n, dtype=np.float32)
    x = np.stack([np.sin(i), np.cos(i * 0.3), np.ones_like(i)], axis=1)
    return x, (np.arange(n) % 5 * 0.2).astype(np.float32)


def backed_up(variant, backup_dir, notice):
    """Keras fit under BackupAndRestore, a notice (as in ``preempted``) after a
    global step. ``tfkeras``: tf_keras with ``save_before_preemption=True`` (no
    periodic backup); ``keras3``: Keras 3 backing up every CKPT_EVERY batches.
    Reports where fit started (epoch, step); rank 0 keeps the weights and
    optimizer variables fit started from (``<run>-start-<step>.npz``) and had
    after each step (``<run>-at-<step>.npz``), in the first run that got there."""
    keras = __import__("tf_keras" if variant == "tfkeras" else "keras")
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)]
        )
        deterministic_weights(model)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    if variant == "tfkeras":
        backup = keras.callbacks.BackupAndRestore(
            backup_dir, save_freq=False, save_before_preemption=True
        )
    else:
        backup = keras.callbacks.BackupAndRestore(backup_dir, save_freq=CKPT_EVERY)
    signame, noticing, notice_step = _noticing(notice)
    name = os.path.basename(backup_dir)

    def keep(when):  # (rank 0) the weights and the optimizer's variables, first run's
        if rank == 0 and not os.path.exists(f"{backup_dir}-{when}.npz"):
            state = [*model.get_weights(), *(v.numpy() for v in model.optimizer.variables)]
            np.savez(f"{backup_dir}-{when}.npz", *state)

    class Probe(keras.callbacks.Callback):  # (after `backup`: sees what it restored)
        def on_train_begin(self, logs=None):
            self.epoch = self.started = None

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = int(epoch)

        def on_train_batch_begin(self, batch, logs=None):
            if self.started is None:
                self.started = self.epoch * BATCHES_PER_EPOCH + int(batch)
                report(event="start", run=name, start_step=self.started, epoch=self.epoch)
                keep(f"start-{self.started}")
                atexit.register(lambda: report(event="exit", run=name, steps=self.steps))
            self.steps = self.epoch * BATCHES_PER_EPOCH + batch + 1

        def on_train_batch_end(self, batch, logs=None):
            keep(f"at-{self.steps}")
            if self.steps == notice_step and rank in noticing:
                report(event="notice", step=self.steps, signal=signame)
                os.kill(os.getpid(), getattr(signal, signame))

    x, y = _examples()
    model.fit(
        x,
        y,
        batch_size=GLOBAL_BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[backup, Probe()],
    )
    return model


# Each further argument is one run: variant:directory:kill_step (0: no kill).
for run in sys.argv[6:]:
    variant, name, kill_step = run.split(":")
    directory = os.path.join(WORKDIR, f"{variant}-{name}")
    if variant in ("tfkeras", "keras3"):
        model = backed_up(variant, directory, kill_step)
    else:
        run_it = {"custom": custom, "keras": keras, "handler": preempted}[variant]
        model = run_it(directory, kill_step if variant == "handler" else int(kill_step))
    if rank == 0:
        np.savez(os.path.join(WORKDIR, f"{variant}-{name}.npz"), *model.get_weights())
    report(event="done", variant=variant, name=name)
