"""Run by tests/launchers/test_security.py on 2 ranks: ``python security_report.py OUT``.

Each rank records its listening sockets right after MPI.Init and again after
MPIStrategy has trained (custom loop and Keras fit / evaluate / predict), how
often mpi4py pickled or unpickled during that training, and (rank 0) the
permission bits of every checkpoint and export written under umask 022 and
077 into OUT; it prints them as one REPORT line (JSON). The test shows that
no socket is opened, nothing is unpickled, and the files follow the umask.
"""

import json
import os
import pickle
import sys

from mpi4py import MPI  # initialises MPI

OUT = sys.argv[1]
comm = MPI.COMM_WORLD
rank = comm.Get_rank()


def listening_sockets():
    # Sockets are matched by inode: /proc/net/* lists the whole network namespace.
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (e.g. the fd of listdir itself)
            continue
        if target.startswith("socket:["):
            mine.add(target[len("socket:[") : -1])
    found = []
    for proto in ("tcp", "tcp6"):
        with open(f"/proc/net/{proto}") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in mine:  # 0A: TCP_LISTEN
                    found.append(f"{proto} {fields[1]}")
    with open("/proc/net/unix") as f:
        for line in f.read().splitlines()[1:]:
            fields = line.split()
            if int(fields[3], 16) & 0x10000 and fields[6] in mine:  # __SO_ACCEPTCON
                found.append("unix " + (fields[7] if len(fields) > 7 else "(unnamed)"))
    return sorted(found)


after_init = listening_sockets()

import keras
import numpy as np
import tensorflow as tf

import mpi_strategy

strategy = mpi_strategy.MPIStrategy()

calls = {"dumps": 0, "loads": 0}


def counting_dumps(obj, *args, **kwargs):
    calls["dumps"] += 1
    return pickle.dumps(obj, *args, **kwargs)


def counting_loads(data, *args, **kwargs):
    calls["loads"] += 1
    return pickle.loads(data, *args, **kwargs)


MPI.pickle.__init__(counting_dumps, counting_loads)

# -- a custom loop over a distributed dataset, to its end ----------------------
GLOBAL_BATCH = 8
x = np.sin(np.arange(GLOBAL_BATCH * 5 * 3, dtype=np.float32)).reshape(-1, 3)
y = (np.arange(len(x)) % 2).astype(np.float32)
with strategy.scope():
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)]
    )
    optimizer = keras.optimizers.Adam(0.01)
    optimizer.build(model.trainable_variables)


@tf.function
def train_step(batch):
    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum((model(xb)[:, 0] - yb) ** 2) / GLOBAL_BATCH
        optimizer.apply_gradients(
            zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        )
        return loss

    losses = strategy.run(replica_step, args=batch)
    return strategy.reduce("SUM", losses, axis=None), strategy.gather(losses, axis=0)


dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
for batch in strategy.experimental_distribute_dataset(dataset):
    train_step(batch)

# -- Keras fit / evaluate / predict ---------------------------------------------
with strategy.scope():
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=["mae"])
model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0)
model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0)
model.predict(x, batch_size=GLOBAL_BATCH, verbose=0)

during_training = dict(calls)
comm.allgather(rank)  # pickles: shows that the hooks see mpi4py's pickling
hooks_work = calls["loads"] > during_training["loads"]
MPI.pickle.__init__(pickle.dumps, pickle.loads)
after_training = listening_sockets()

# -- files written under each umask ------------------------------------------------
modes = {}
for umask in (0o022, 0o077):
    previous = os.umask(umask)
    base = os.path.join(OUT, f"umask{umask:03o}")
    if rank == 0:
        os.makedirs(base)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    tf.train.CheckpointManager(checkpoint, os.path.join(base, "manager"), max_to_keep=2).save()
    checkpoint.write(os.path.join(base, "plain", "ckpt"))
    model.save(os.path.join(base, "model.keras"))
    model.export(os.path.join(base, "export"), verbose=False)
    module = tf.Module()
    with strategy.scope():  # the strategy's, so that its save is written once
        module.v = tf.Variable([1.0, 2.0])
    # Traced (by the save below) while `module` is this iteration's.
    module.f = tf.function(lambda t: t * module.v, input_signature=[tf.TensorSpec([2])])  # noqa: B023
    tf.saved_model.save(module, os.path.join(base, "saved_model"))
    os.umask(previous)
    if rank == 0:
        for directory, dirnames, filenames in os.walk(base):
            for name in ["", *dirnames, *filenames]:
                path = os.path.join(directory, name)
                modes[os.path.relpath(path, OUT)] = os.stat(path).st_mode & 0o7777

print(
    "REPORT "
    + json.dumps(
        dict(
            rank=rank,
            after_init=after_init,
            after_training=after_training,
            during_training=during_training,
            hooks_work=hooks_work,
            modes=modes,
        )
    ),
    flush=True,
)
