"""Reduction time inside tf.function, MPIStrategy vs raw mpi4py Allreduce (the floor).

Run under mpiexec; rank 0 prints one JSON line per size.
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpi_strategy  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
COMM = MPI.COMM_WORLD


def timed(fn, repeats):
    fn()
    fn()
    COMM.Barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    elapsed = (time.perf_counter() - start) / repeats
    return COMM.allreduce(elapsed, op=MPI.MAX)


def main():
    strategy = mpi_strategy.MPIStrategy()
    sizes = [int(s) for s in sys.argv[1:]] or [4 ** k for k in range(1, 14)]  # bytes
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        repeats = max(5, min(300, int(2e8 / (nbytes + 1e5))))
        x = tf.ones([n], tf.float32)

        @tf.function
        def with_reduce():
            per_replica = strategy.run(lambda: x * 1.0)
            return strategy.reduce("SUM", per_replica, axis=None)

        @tf.function
        def without_reduce():
            return strategy.experimental_local_results(strategy.run(lambda: x * 1.0))[0]

        send, recv = np.ones(n, np.float32), np.empty(n, np.float32)
        t_mpi = timed(lambda: COMM.Allreduce(send, recv), repeats)
        t_with = timed(lambda: with_reduce().numpy(), repeats)
        t_without = timed(lambda: without_reduce().numpy(), repeats)
        size = COMM.Get_size()
        bus_bandwidth = 2 * (size - 1) / size * n * 4 / max(t_with - t_without, 1e-9)
        if COMM.Get_rank() == 0:
            print(json.dumps({
                "bytes": n * 4, "ranks": size, "raw_allreduce_ms": t_mpi * 1e3,
                "tf_function_with_reduce_ms": t_with * 1e3,
                "tf_function_without_reduce_ms": t_without * 1e3,
                "reduce_overhead_ms": (t_with - t_without) * 1e3,
                "ratio_to_raw": (t_with - t_without) / t_mpi,
                "bus_bandwidth_GBps": bus_bandwidth / 1e9}), flush=True)


if __name__ == "__main__":
    main()
