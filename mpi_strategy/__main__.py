"""``python -m mpi_strategy``: check a new cluster before training on it.

    mpiexec -n 4 python -m mpi_strategy

Every rank reports its host, MPI library, thread level, TensorFlow version and
devices; then a reduction through MPIStrategy is checked against its known
result. Rank 0 prints one line per rank and a verdict; the exit status is 0
only if every rank passed.
"""

import os
import socket
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    levels = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
              MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    report = {"rank": rank, "host": socket.gethostname(),
              "mpi": " ".join(MPI.Get_library_version().splitlines()[0].split()),
              "thread_level": levels.get(MPI.Query_thread(), "?")}
    try:
        import tensorflow as tf
        import mpi_strategy

        report["tensorflow"] = tf.__version__
        strategy = mpi_strategy.MPIStrategy()
        report["devices"] = ",".join(d.split("/")[-1] for d in strategy.extended.worker_devices)

        def replica_value():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            return tf.cast(replica, tf.float64) + 1.0

        @tf.function
        def global_sum():
            return strategy.reduce("SUM", strategy.run(replica_value), axis=None)

        n = strategy.num_replicas_in_sync
        got = float(global_sum())
        report["allreduce"] = "ok" if got == n * (n + 1) / 2 else f"WRONG ({got})"
    except Exception as exc:  # report every failure; the verdict says which rank
        report["allreduce"] = f"FAILED: {type(exc).__name__}: {exc}"

    reports = comm.gather(report, root=0)
    if rank != 0:
        return 0 if report["allreduce"] == "ok" else 1
    print(f"mpi_strategy {_version()} on {size} rank(s)")
    for r in reports:
        print("  ".join(f"{k}={v}" for k, v in r.items()))
    failed = [r["rank"] for r in reports if r["allreduce"] != "ok"]
    print("RESULT: ok" if not failed else f"RESULT: FAILED on ranks {failed}")
    return 1 if failed else 0


def _version():
    try:
        from mpi_strategy import __version__
        return __version__
    except Exception:  # pragma: no cover
        return "?"


if __name__ == "__main__":
    sys.exit(main())
