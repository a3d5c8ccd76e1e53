"""Reduction time inside tf.function, MPIStrategy vs raw mpi4py Allreduce (the floor).

    mpiexec -n 2 python -m benchmarks.collectives [--quick] [BYTES ...]

Rank 0 prints one JSON line per measurement:

- ``kind: "reduce"``: ``strategy.reduce`` of one float32 tensor of BYTES bytes
  in a tf.function, minus the same function without the reduction, against
  one raw ``Allreduce`` of a numpy buffer of the same size;
- ``kind: "batch_reduce"``: the gradient tensors of a real model (the MLP's 6,
  the CNN's 10) reduced by one ``ReplicaContext.all_reduce`` of the list (what
  the Keras optimizer issues, fused by the strategy), and by one
  ``strategy.reduce`` per tensor, against one raw Allreduce of all their bytes
  (the floor for a fused reduction) and one raw Allreduce per tensor;
  The fused reduction is also timed with ``compression="float16"`` (large
  tensors summed in 16 bits: half the bytes, plus the casts);
- ``kind: "check"``: the agreement check that precedes every collective
  (``agreement.Agreement.agree``: one small Allgather), for one scalar and
  for the MLP's 6 gradient shapes.

Times are the median of individually timed calls, the slowest rank's.
Bus bandwidth follows the usual allreduce convention: 2(n-1)/n x bytes / time.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf
from mpi4py import MPI

import mpi_strategy
from benchmarks import models

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)
COMM = MPI.COMM_WORLD
DEFAULT_SIZES = [4, 4096, 65536, 1048576, 7450000, 67108864]
BATCH_MODELS = ["mlp", "cnn"]


def timed(fn, repeats):
    """Median seconds per call of ``fn`` (after 2 warm-up calls), slowest rank."""
    fn()
    fn()
    COMM.Barrier()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return COMM.allreduce(float(np.median(times)), op=MPI.MAX)


def repeats_for(nbytes, quick):
    n = max(5, min(300, int(2e8 / (nbytes + 1e5))))
    return max(3, n // 6) if quick else n


def bus_bandwidth_gbps(nbytes, seconds):
    size = COMM.Get_size()
    return 2 * (size - 1) / size * nbytes / max(seconds, 1e-12) / 1e9


def measure_reduce(strategy, nbytes, quick):
    n = max(1, nbytes // 4)
    repeats = repeats_for(n * 4, quick)
    x = tf.ones([n], tf.float32)

    @tf.function
    def with_reduce():
        per_replica = strategy.run(lambda: x * 1.0)
        return strategy.reduce("SUM", per_replica, axis=None)

    @tf.function
    def without_reduce():
        return strategy.experimental_local_results(strategy.run(lambda: x * 1.0))[0]

    send, recv = np.ones(n, np.float32), np.empty(n, np.float32)
    t_raw = timed(lambda: COMM.Allreduce(send, recv), repeats)
    t_with = timed(lambda: with_reduce().numpy(), repeats)
    t_without = timed(lambda: without_reduce().numpy(), repeats)
    overhead = t_with - t_without
    return {
        "kind": "reduce",
        "bytes": n * 4,
        "ranks": COMM.Get_size(),
        "repeats": repeats,
        "raw_allreduce_ms": t_raw * 1e3,
        "tf_function_with_reduce_ms": t_with * 1e3,
        "tf_function_without_reduce_ms": t_without * 1e3,
        "reduce_overhead_ms": overhead * 1e3,
        "ratio_to_raw": overhead / t_raw,
        "raw_bus_bandwidth_GBps": bus_bandwidth_gbps(n * 4, t_raw),
        "strategy_bus_bandwidth_GBps": bus_bandwidth_gbps(n * 4, overhead),
    }


def measure_batch_reduce(strategy, strategy_float16, model, quick):
    shapes = models.gradient_shapes(model)
    tensors = [tf.ones(s, tf.float32) for s in shapes]
    nbytes = sum(int(np.prod(s)) * 4 for s in shapes)
    repeats = repeats_for(nbytes, quick)

    def fresh():
        return [t * 1.0 for t in tensors]

    def fused_with(strategy):
        @tf.function
        def fused():
            def replica_fn():
                return tf.distribute.get_replica_context().all_reduce("SUM", fresh())

            return strategy.experimental_local_results(strategy.run(replica_fn))[0]

        return fused

    fused, fused_float16 = fused_with(strategy), fused_with(strategy_float16)

    @tf.function
    def one_by_one():
        per_replica = strategy.run(fresh)
        return [strategy.reduce("SUM", v, axis=None) for v in per_replica]

    @tf.function
    def without_reduce():
        return strategy.experimental_local_results(strategy.run(fresh))[0]

    def fetch(fn):
        return lambda: [t.numpy() for t in fn()]

    send = np.ones(nbytes // 4, np.float32)
    recv = np.empty_like(send)
    sends = [np.ones(int(np.prod(s)), np.float32) for s in shapes]
    recvs = [np.empty_like(s) for s in sends]

    def raw_each():
        for s, r in zip(sends, recvs):
            COMM.Allreduce(s, r)

    t_raw = timed(lambda: COMM.Allreduce(send, recv), repeats)
    t_raw_each = timed(raw_each, repeats)
    t_without = timed(fetch(without_reduce), repeats)
    t_fused = timed(fetch(fused), repeats) - t_without
    t_each = timed(fetch(one_by_one), repeats) - t_without
    t_float16 = timed(fetch(fused_float16), repeats) - t_without
    return {
        "kind": "batch_reduce",
        "model": model,
        "tensors": len(shapes),
        "bytes": nbytes,
        "ranks": COMM.Get_size(),
        "repeats": repeats,
        "raw_allreduce_ms": t_raw * 1e3,
        "raw_allreduce_per_tensor_ms": t_raw_each * 1e3,
        "tf_function_without_reduce_ms": t_without * 1e3,
        "fused_reduce_overhead_ms": t_fused * 1e3,
        "per_tensor_reduce_overhead_ms": t_each * 1e3,
        "fused_float16_reduce_overhead_ms": t_float16 * 1e3,
        "ratio_to_raw": t_fused / t_raw,
        "raw_bus_bandwidth_GBps": bus_bandwidth_gbps(nbytes, t_raw),
        "strategy_bus_bandwidth_GBps": bus_bandwidth_gbps(nbytes, t_fused),
    }


def measure_check(quick):
    """The always-on agreement check before every collective, alone."""
    from mpi_strategy._src.core.agreement import Agreement
    from mpi_strategy._src.core.kinds import ALLREDUCE

    agreement = Agreement(COMM)
    shapes = [tuple(s) for s in models.gradient_shapes("mlp")]
    repeats = 200 if quick else 2000
    t_one = timed(lambda: agreement.agree(ALLREDUCE, np.float32, [()]), repeats)
    t_mlp = timed(lambda: agreement.agree(ALLREDUCE, np.float32, shapes), repeats)
    return {
        "kind": "check",
        "ranks": COMM.Get_size(),
        "repeats": repeats,
        "check_scalar_ms": t_one * 1e3,
        "check_mlp_gradients_ms": t_mlp * 1e3,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("sizes", nargs="*", type=int, help="bytes per single-tensor reduce")
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    strategy = mpi_strategy.MPIStrategy()
    rows = [measure_reduce(strategy, b, args.quick) for b in args.sizes or DEFAULT_SIZES]
    strategy_float16 = mpi_strategy.MPIStrategy(compression="float16")
    rows += [measure_batch_reduce(strategy, strategy_float16, m, args.quick) for m in BATCH_MODELS]
    rows.append(measure_check(args.quick))
    if COMM.Get_rank() == 0:
        for row in rows:
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
