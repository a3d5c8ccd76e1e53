"""Training-step time and peak memory of one workload under one strategy.

    python -m benchmarks.train_step mlp none                # no strategy, one process
    mpiexec -n K python -m benchmarks.train_step mlp mpi    # MPIStrategy on K ranks
    TF_CONFIG=... python -m benchmarks.train_step mlp mwms  # one MultiWorkerMirroredStrategy worker
    python -m benchmarks.train_step mlp none --batch 128    # one half of the ceiling pair
    python -m benchmarks.train_step lenet3,cnn,higgs none --batch 32   # several, one after another
    mpirun --with-ft ulfm -n 2 python -m benchmarks.train_step mlp mpi --elastic-commit-every 10
    mpiexec -n K python -m mpi_strategy.horovod -m benchmarks.train_step mlp horovod
    mpiexec -n K python -m benchmarks.train_step mlp horovod  # with the real Horovod installed

Every process prints one JSON line per model: the median step time of the
timed steps, its peak RSS (VmHWM) and, for models with sparse gradients, the
gradient types before and after the strategy's all-reduce. The step is the
same custom loop for every strategy (tf.keras layers and optimizer, no
``fit``: Keras 3's ``fit`` is broken under MultiWorkerMirroredStrategy).
Mode ``horovod`` is the same step written for Horovod (no strategy; each rank
its share of the global batch; ``DistributedGradientTape`` averages the
gradients): with whatever ``horovod`` imports, the real one or
``mpi_strategy.horovod``.
With ``--elastic-commit-every N`` the timed loop runs inside
``mpi_strategy.elastic.run`` and commits every N steps (0: never in the loop).
A failure is printed as a JSON line with an ``error`` field, so the driver
can record it instead of dropping the row.
"""

import argparse
import contextlib
import json
import os
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf

# The same threads in every process of every variant.
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)

from benchmarks import models  # noqa: E402


def peak_rss_mb():
    """This process's peak resident set size (VmHWM), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_strategy(mode):
    """(strategy, rank, number of processes) for ``mode``."""
    if mode == "mpi":
        from mpi4py import MPI

        import mpi_strategy

        strategy = mpi_strategy.MPIStrategy()
        return strategy, MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if mode == "mwms":
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING
        )
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
        resolver = strategy.cluster_resolver
        return strategy, resolver.task_id, len(resolver.cluster_spec().as_dict()["worker"])
    if mode == "horovod":
        import horovod.tensorflow as hvd

        hvd.init()
        return HorovodReplicas(hvd), hvd.rank(), hvd.size()
    return tf.distribute.get_strategy(), 0, 1  # the default (no) strategy


class HorovodReplicas:
    """What run_model needs of a strategy, for Horovod's way (no strategy):
    one replica per rank, the step written with DistributedGradientTape."""

    def __init__(self, hvd):
        self.hvd = hvd
        self.num_replicas_in_sync = hvd.size()

    def scope(self):
        return contextlib.nullcontext()

    def run(self, fn):
        return fn()


def run_model(name, strategy, global_batch, steps, warmup, commit_every=None):
    replicas = strategy.num_replicas_in_sync
    if global_batch % replicas:
        raise ValueError(f"global batch {global_batch} is not divisible by {replicas} replicas")
    x, y = models.batch(name, global_batch // replicas)
    with strategy.scope():
        model = models.build(name)
        optimizer = tf.keras.optimizers.SGD(0.01)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def gradients():
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                loss_fn(y, model(x, training=True)), global_batch_size=global_batch
            )
        return loss, tape.gradient(loss, model.trainable_variables)

    def replica_step():
        loss, grads = gradients()
        # The optimizer all-reduces the gradients (one ReplicaContext.all_reduce).
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    if isinstance(strategy, HorovodReplicas):
        replica_step = horovod_step(strategy.hvd, model, optimizer, loss_fn, x, y)

    @tf.function
    def step():
        return strategy.run(replica_step)

    # Which gradient types reach the optimizer, and which come out of the
    # strategy's all-reduce (the call the optimizer makes); read at trace time.
    seen = {}

    def reduce_only():
        _, grads = gradients()
        reduced = tf.distribute.get_replica_context().all_reduce("SUM", grads)
        seen["before"] = _type_names(grads)
        seen["after"] = _type_names(reduced)
        return tf.add_n([tf.reduce_sum(tf.convert_to_tensor(g)) for g in reduced])

    if isinstance(strategy, HorovodReplicas):
        seen.update(before=["dense"], after=["dense"])
    else:
        tf.function(lambda: strategy.run(reduce_only))()

    def timed_steps(state=None):
        times = []
        for _ in range(warmup + steps):
            start = time.perf_counter()
            step()
            model.trainable_variables[0].numpy()  # wait for the step to finish
            if state is not None:  # a commit counts in its step's time
                state.step += 1
                if commit_every and state.step % commit_every == 0:
                    state.commit()
            times.append(time.perf_counter() - start)
        return times

    if commit_every is None:
        times = timed_steps()
    else:  # no rank is lost here: the loop is not written to resume
        from mpi_strategy import elastic

        state = elastic.State(model, optimizer, step=0)
        times = elastic.run(strategy, state)(timed_steps)()
    timed = np.array(times[warmup:])
    return {
        "replicas": replicas,
        "global_batch": global_batch,
        "params": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
        "ms_per_step": float(np.median(timed)) * 1e3,
        "ms_per_step_mean": float(np.mean(timed)) * 1e3,
        "ms_per_step_p10_p90": [float(np.percentile(timed, q)) * 1e3 for q in (10, 90)],
        "state_bytes": int(sum(v.numpy().nbytes for v in model.variables + optimizer.variables)),
        "grad_types_before_reduce": seen["before"],
        "grad_types_after_reduce": seen["after"],
    }


def horovod_step(hvd, model, optimizer, loss_fn, x, y):
    """The step as Horovod's examples write it: each rank's mean loss, the
    gradients averaged over the ranks by DistributedGradientTape."""

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_fn(y, model(x, training=True)))
        grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("models", help="comma-separated: " + ",".join(models.BUILDERS))
    parser.add_argument("mode", choices=["none", "mpi", "mwms", "horovod"])
    parser.add_argument("--batch", type=int, default=256, help="global batch")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument(
        "--elastic-commit-every",
        type=int,
        metavar="N",
        help="mpi mode: time the loop inside elastic.run, committing every "
        "N steps (0: no commits in the loop)",
    )
    args = parser.parse_args()
    if args.elastic_commit_every is not None and args.mode != "mpi":
        parser.error("--elastic-commit-every needs mode mpi")

    rank, processes = 0, 1
    try:
        strategy, rank, processes = make_strategy(args.mode)
    except Exception as e:  # noqa: BLE001 - e.g. MWMS cannot start its server: record, do not drop
        print(json.dumps({"mode": args.mode, "rank": -1, "error": _describe(e)}), flush=True)
        sys.exit(0)
    for name in args.models.split(","):
        row = {"model": name, "mode": args.mode, "rank": rank, "processes": processes}
        try:
            row.update(
                run_model(
                    name, strategy, args.batch, args.steps, args.warmup, args.elastic_commit_every
                )
            )
        except Exception as e:
            if args.mode in ("mpi", "horovod"):
                raise  # the strategy's hook aborts the whole job; the driver records it
            row["error"] = _describe(e)
        row["peak_rss_mb"] = peak_rss_mb()
        print(json.dumps(row), flush=True)


def _type_names(values):
    return sorted({"IndexedSlices" if isinstance(g, tf.IndexedSlices) else "dense" for g in values})


def _describe(e):
    return f"{type(e).__name__}: {e}"[:500] + " | " + traceback.format_exc()[-1500:]


if __name__ == "__main__":
    main()
