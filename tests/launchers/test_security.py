"""Security properties of a training job (stated in docs/security.md).

One 2-rank launch records, on every rank:

* the listening sockets of the process (``/proc/net/tcp``, ``tcp6`` and
  ``unix`` entries in LISTEN state whose inode is one of this process's file
  descriptors) right after ``MPI.Init``, and again after MPIStrategy has been
  built and has trained (custom loop and Keras fit / evaluate / predict);
* how many times mpi4py unpickled or pickled data during that training (its
  pickle hooks, ``MPI.pickle.__init__(dumps, loads)``, count every call);
* the permission bits of every file and directory written by
  ``tf.train.Checkpoint`` / ``CheckpointManager``, Keras ``model.save``
  (``.keras``), ``model.export`` and ``tf.saved_model.save`` through
  every rank's same call, under umask 022 and 077.
"""

import json
import os
import re
import sys

import pytest

from mpi_strategy._src.core.launch import run_mpiexec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UMASKS = (0o022, 0o077)

JOB = r"""
import json, os, pickle, sys
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
            mine.add(target[len("socket:["):-1])
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

import numpy as np
import tensorflow as tf
import keras
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
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"),
                              keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adam(0.01)
    optimizer.build(model.trainable_variables)


@tf.function
def train_step(batch):
    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum((model(xb)[:, 0] - yb) ** 2) / GLOBAL_BATCH
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables))
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
    module.v = tf.Variable([1.0, 2.0])
    module.f = tf.function(lambda t: t * module.v, input_signature=[tf.TensorSpec([2])])
    tf.saved_model.save(module, os.path.join(base, "saved_model"))
    os.umask(previous)
    if rank == 0:
        for directory, dirnames, filenames in os.walk(base):
            for name in [""] + dirnames + filenames:
                path = os.path.join(directory, name)
                modes[os.path.relpath(path, OUT)] = os.stat(path).st_mode & 0o7777

print("REPORT " + json.dumps(dict(
    rank=rank, after_init=after_init, after_training=after_training,
    during_training=during_training, hooks_work=hooks_work, modes=modes)), flush=True)
"""


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Every rank's report of one 2-rank launch of JOB, by rank."""
    workdir = tmp_path_factory.mktemp("security")
    (workdir / "job.py").write_text(JOB)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    code, out = run_mpiexec(2, [sys.executable, str(workdir / "job.py"), str(workdir / "out")],
                            timeout=240, env=env)
    assert code == 0, out[-5000:]
    plain = re.sub(r"\[\d+\] ?", "", out)
    # Other ranks' output may be joined to a report line: decode just the object.
    decoder = json.JSONDecoder()
    found = [decoder.raw_decode(plain, m.end())[0] for m in re.finditer("REPORT ", plain)]
    by_rank = {r["rank"]: r for r in found}
    assert sorted(by_rank) == [0, 1], out[-5000:]
    return by_rank


@pytest.mark.single_process
def test_no_listening_socket_beyond_what_mpi_init_opened(reports):
    for rank, report in reports.items():
        new = set(report["after_training"]) - set(report["after_init"])
        assert not new, f"rank {rank} listens on {sorted(new)} after training"


@pytest.mark.single_process
def test_nothing_is_unpickled_in_the_training_path(reports):
    for rank, report in reports.items():
        assert report["hooks_work"], f"rank {rank}: the pickle hooks saw nothing"
        assert report["during_training"]["loads"] == 0, (rank, report["during_training"])


@pytest.mark.single_process
@pytest.mark.parametrize("umask", UMASKS, ids=lambda m: f"umask{m:03o}")
def test_checkpoints_and_exports_follow_the_umask(reports, umask):
    modes = {path: mode for path, mode in reports[0]["modes"].items()
             if path.split(os.sep)[0] == f"umask{umask:03o}"}
    # One of each kind of output was written (on rank 0, in the real place).
    for part in ("manager/checkpoint", "plain/ckpt.index", "model.keras",
                 "export/saved_model.pb", "saved_model/saved_model.pb",
                 "saved_model/variables"):
        assert os.path.join(f"umask{umask:03o}", part) in modes, sorted(modes)
    too_open = {path: oct(mode) for path, mode in modes.items() if mode & (umask | 0o7000)}
    assert not too_open, f"more permissive than umask {umask:03o} allows: {too_open}"
    assert reports[1]["modes"] == {}  # rank 1 wrote nothing
