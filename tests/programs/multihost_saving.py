"""Run by tests/system/test_multihost.py on 2 namespace hosts x 2 ranks:
``python multihost_saving.py --out DIR --dirs place=directory...``.

Every rank makes the same saves (CheckpointManager, keras.Model.save) into
each directory, then loads what it saved from its own view of the path, and
writes a report (bytes written, loaded or not) to DIR. Shows that a save
lands once per filesystem: once on a shared one, once per host on node-local
ones.
"""

import argparse
import json
import os
import socket

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np
import tensorflow as tf
from mpi4py import MPI

tf.config.threading.set_intra_op_parallelism_threads(1)
import keras

import mpi_strategy

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--dirs", nargs="+", required=True)  # place=directory
args = parser.parse_args()
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
FEATURES, UNITS = 256, 1024  # ~1 MB of weights, ~3 MB with Adam's slots: a copy stands out


def written_bytes():
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))


def new_model():
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(UNITS, activation="relu"),
            keras.layers.Dense(2),
        ]
    )


strategy = mpi_strategy.MPIStrategy()
with strategy.scope():
    model = new_model()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
batch = 2 * size
x = np.linspace(0, 1, batch * FEATURES, dtype=np.float32).reshape(batch, FEATURES)
model.fit(x, np.ones((batch, 2), np.float32), batch_size=batch, epochs=1, verbose=0)
expected = model.get_weights()


def save_checkpoint(directory):
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    tf.train.CheckpointManager(checkpoint, os.path.join(directory, "ckpt"), 1).save()


def load_checkpoint(directory):
    # Into a model of this rank alone: a load never meets the other ranks.
    path = tf.train.latest_checkpoint(os.path.join(directory, "ckpt"))
    if path is None:
        raise FileNotFoundError(f"no checkpoint in {directory}/ckpt")
    fresh = new_model()
    status = tf.train.Checkpoint(model=fresh).restore(path).expect_partial()
    status.assert_existing_objects_matched()
    return fresh.get_weights()


def save_keras(directory):
    model.save(os.path.join(directory, "x.keras"))


def load_keras(directory):
    return keras.models.load_model(os.path.join(directory, "x.keras")).get_weights()


SAVES = {
    "CheckpointManager.save": (save_checkpoint, load_checkpoint),
    "keras.Model.save": (save_keras, load_keras),
}
node = world.Split_type(MPI.COMM_TYPE_SHARED)
report = {
    "rank": rank,
    "host": socket.gethostname(),
    "node_rank": node.Get_rank(),
    "node_size": node.Get_size(),
    "saves": {},
}
for place, directory in (d.split("=", 1) for d in args.dirs):
    for name, (save, load) in SAVES.items():
        before = written_bytes()
        save(directory)
        entry = {"write_bytes": written_bytes() - before, "loaded": False}
        try:
            weights = load(directory)
            entry["loaded"] = len(weights) == len(expected) and all(
                np.array_equal(a, b) for a, b in zip(weights, expected)
            )
        except Exception as e:  # noqa: BLE001 - reported; the test fails on it
            entry["error"] = f"{type(e).__name__}: {e}"[:500]
        report["saves"][f"{place} {name}"] = entry
with open(os.path.join(args.out, f"report{rank}.json"), "w") as f:
    json.dump(report, f)
