"""``python -m mpi_strategy``: check a new cluster before training on it.

    mpiexec -n 4 python -m mpi_strategy
    python -m mpi_strategy timeline trace.json   # merge a timeline's per-rank files

Every rank reports its host, MPI library, thread level, TensorFlow version,
which engine runs the collectives (``kernels=native``: compiled kernels;
``python``: see ``MPI_STRATEGY_KERNELS`` in docs/concepts.md) and devices;
then a reduction through MPIStrategy is checked against its known
result. Rank 0 prints one line per rank and a verdict; the exit status is 0
only if every rank passed. The reports travel as bytes (Gather of lengths,
Gatherv of UTF-8 text), never as pickles, like everything else mpi_strategy
sends.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mpi4py import MPI

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    levels = {
        MPI.THREAD_SINGLE: "single",
        MPI.THREAD_FUNNELED: "funneled",
        MPI.THREAD_SERIALIZED: "serialized",
        MPI.THREAD_MULTIPLE: "multiple",
    }
    report = {
        "rank": rank,
        "host": socket.gethostname(),
        "mpi": " ".join(MPI.Get_library_version().splitlines()[0].split()),
        "thread_level": levels.get(MPI.Query_thread(), "?"),
    }
    try:
        import tensorflow as tf

        import mpi_strategy

        report["tensorflow"] = tf.__version__
        from mpi_strategy._src.native import engine

        report["kernels"] = engine.active()
        strategy = mpi_strategy.MPIStrategy()
        report["devices"] = ",".join(d.split("/")[-1] for d in strategy.extended.worker_devices)

        def replica_value() -> Any:
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            return tf.cast(replica, tf.float64) + 1.0

        @tf.function
        def global_sum() -> Any:
            return strategy.reduce("SUM", strategy.run(replica_value), axis=None)

        n = strategy.num_replicas_in_sync
        got = float(global_sum())
        report["allreduce"] = "ok" if got == n * (n + 1) / 2 else f"WRONG ({got})"
    except Exception as exc:  # noqa: BLE001 - report every failure; the verdict says which rank
        report["allreduce"] = f"FAILED: {type(exc).__name__}: {exc}"

    passed = report["allreduce"] == "ok"
    lines = _gather_lines(comm, "  ".join(f"{k}={v}" for k, v in report.items()), passed)
    if rank != 0:
        return 0 if passed else 1
    assert lines is not None  # (rank 0)
    print(f"mpi_strategy {_version()} on {size} rank(s)")
    for line, _ in lines:
        print(line)
    failed = [r for r, (_, ok) in enumerate(lines) if not ok]
    print("RESULT: ok" if not failed else f"RESULT: FAILED on ranks {failed}")
    return 1 if failed else 0


def _gather_lines(comm: MPI.Intracomm, line: str, passed: bool) -> list[tuple[str, bool]] | None:
    """On rank 0, every rank's ``(line, passed)`` in rank order (None elsewhere).

    Byte buffers, not pickles: a Gather of (length, passed), then a Gatherv of
    the UTF-8 bytes of every line.
    """
    import numpy as np
    from mpi4py import MPI

    data = np.frombuffer(line.encode("utf-8"), np.uint8)
    mine = np.array([data.size, int(passed)], np.int64)
    everyone = np.empty((comm.Get_size(), 2), np.int64) if comm.Get_rank() == 0 else None
    comm.Gather(mine, everyone, root=0)
    if comm.Get_rank() != 0:
        comm.Gatherv(data, None, root=0)
        return None
    assert everyone is not None  # (rank 0)
    counts = everyone[:, 0].tolist()
    received = np.empty(sum(counts), np.uint8)
    comm.Gatherv(data, [received, (counts, None), MPI.BYTE], root=0)
    ends = np.cumsum(counts).tolist()
    return [
        (received[end - n : end].tobytes().decode("utf-8", errors="replace"), bool(ok))
        for end, n, ok in zip(ends, counts, everyone[:, 1].tolist())
    ]


def _version() -> str:
    try:
        from mpi_strategy import __version__

        return __version__
    except Exception:  # noqa: BLE001 - only informative  # pragma: no cover
        return "?"


if __name__ == "__main__":
    if sys.argv[1:2] == ["timeline"]:
        from mpi_strategy import timeline

        sys.exit(timeline.main(sys.argv[2:]))
    sys.exit(main())
