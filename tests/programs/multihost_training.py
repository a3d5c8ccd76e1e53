"""Run by tests/system/test_multihost.py: one program for every launch, on one
host or across network-namespace "hosts".

``python multihost_training.py --out DIR --steps N [--phases JSON]
[--timed-steps K] [--warmup-steps W] [--until-killed] [--compression C]``:
trains N steps and writes each rank's losses, weights, host and the
collectives it issued (counted by a COMM_WORLD wrapper) to DIR; then times
steps under each link shaping phase; ``--until-killed`` trains on (at most
120 s) until the test kills a host. Shows that results across hosts match a
single host, that step times follow the alpha-beta model, and that a dead
host ends the job.
"""

import argparse
import json
import os
import socket
import subprocess
import time
from typing import ClassVar

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The Python engine: the traffic is counted as mpi4py calls (CountingComm);
# the native kernels call MPI from C, with the same messages.
os.environ["MPI_STRATEGY_KERNELS"] = "python"
import numpy as np
import tensorflow as tf
from mpi4py import MPI

tf.config.threading.set_intra_op_parallelism_threads(1)
import mpi_strategy

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--phases", default="[]")  # JSON: [{"name", "commands"}]: timed shaping phases
parser.add_argument("--timed-steps", type=int, default=6)
parser.add_argument("--warmup-steps", type=int, default=2)
parser.add_argument("--until-killed", action="store_true")
parser.add_argument("--compression", default=None)
args = parser.parse_args()


def nbytes(buf):
    """Bytes in an mpi4py buffer argument (an array, or [array, ...])."""
    return memoryview(buf[0] if isinstance(buf, (list, tuple)) else buf).nbytes


class CountingComm(MPI.Intracomm):
    """COMM_WORLD that logs each collective the strategy issues, with the bytes
    this rank contributes (blocking and nonblocking forms alike)."""

    log: ClassVar[list] = []  # one for the class: read as CountingComm.log

    def _log(self, name, sendbuf, recvbuf=None):
        self.log.append([name, nbytes(recvbuf if sendbuf is MPI.IN_PLACE else sendbuf)])

    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        self._log("Allreduce", sendbuf, recvbuf)
        return super().Allreduce(sendbuf, recvbuf, op)

    def Iallreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        self._log("Allreduce", sendbuf, recvbuf)
        return super().Iallreduce(sendbuf, recvbuf, op)

    def Allgather(self, sendbuf, recvbuf):
        self._log("Allgather", sendbuf, recvbuf)
        return super().Allgather(sendbuf, recvbuf)

    def Iallgather(self, sendbuf, recvbuf):
        self._log("Allgather", sendbuf, recvbuf)
        return super().Iallgather(sendbuf, recvbuf)

    def Allgatherv(self, sendbuf, recvbuf):
        self._log("Allgatherv", sendbuf, recvbuf)
        return super().Allgatherv(sendbuf, recvbuf)

    def Alltoall(self, sendbuf, recvbuf):
        self._log("Alltoall", sendbuf, recvbuf)
        return super().Alltoall(sendbuf, recvbuf)

    def Bcast(self, buf, root=0):
        self._log("Bcast", buf)
        return super().Bcast(buf, root)

    def Ibcast(self, buf, root=0):
        self._log("Bcast", buf)
        return super().Ibcast(buf, root)


world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
comm = CountingComm(world)
tf.keras.utils.set_random_seed(1)
strategy = mpi_strategy.MPIStrategy(comm=comm, compression=args.compression)

rng = np.random.default_rng(0)
images = rng.random((2048, 784)).astype(np.float32)
labels = np.argmax(images @ rng.standard_normal((784, 10)), axis=1)  # learnable
global_batch = 16 * size
dataset = tf.data.Dataset.from_tensor_slices((images, labels)).repeat().batch(global_batch)
batches = iter(strategy.experimental_distribute_dataset(dataset))

with strategy.scope():
    model = tf.keras.Sequential(
        [
            tf.keras.Input((784,)),
            tf.keras.layers.Dense(128, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )
    optimizer = tf.keras.optimizers.Adam(1e-3)
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


def replica_step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.nn.compute_average_loss(
            loss_fn(y, model(x, training=True)), global_batch_size=global_batch
        )
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


@tf.function
def train_step(batch):
    return strategy.reduce("SUM", strategy.run(replica_step, args=batch), axis=None)


def step():
    return float(train_step(next(batches)))


losses = [step() for _ in range(args.steps)]
node = world.Split_type(MPI.COMM_TYPE_SHARED)
result = {
    "rank": rank,
    "host": socket.gethostname(),
    "ranks_on_node": node.Get_size(),
    "losses": losses,
    "phases": [],
}
np.savez(os.path.join(args.out, f"weights{rank}.npz"), *model.get_weights())

for phase in json.loads(args.phases):
    for command in phase["commands"]:  # shapes this host's own link
        subprocess.run(command, check=True, timeout=60)
    world.Barrier()
    for _ in range(args.warmup_steps):
        step()
    del CountingComm.log[:]
    times = []
    for _ in range(args.timed_steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    result["phases"].append(
        {"name": phase["name"], "step_times": times, "collectives": list(CountingComm.log)}
    )

with open(os.path.join(args.out, f"result{rank}.json"), "w") as f:
    json.dump(result, f)
world.Barrier()
if args.until_killed:
    if rank == 0:
        open(os.path.join(args.out, "training_until_killed"), "w").close()
    deadline = time.monotonic() + 120  # never hang a test run forever
    while time.monotonic() < deadline:
        step()
