"""An opt-in timeline of every collective, per rank: where communication time goes.

    MPI_STRATEGY_TIMELINE=trace.json mpiexec -n 2 python train.py
    python -m mpi_strategy timeline trace.json     # merge the ranks' files into trace.json

Each process writes ``trace.rank<R>.json`` as it goes (``R``: its rank in
``MPI.COMM_WORLD``, so strategies on disjoint sub-communicators never share a
file; a process started to replace a lost rank adds ``-spawned-<pid>``), in Chrome's trace-event
format (chrome://tracing and https://ui.perfetto.dev open it; a file cut short
by a crash still opens). Every collective is one event on its rank's row with
two parts:

* ``wait for ranks``: from entering the collective until every rank has
  entered it (the agreement message, ``agreement.py``): time lost to other
  ranks being late, i.e. to load imbalance and to everything else a step does;
* ``transfer``: moving and summing the data once all ranks are there (the
  MPI call, the copies in and out; for small data, summing what the agreement
  message carried).

Its arguments give the collective's number, the bytes this rank sent and how
many tensors it packed. The timeline is read once, when a collective is first
traced: off, the collectives run unchanged (no timing, no check per call).
"""

from __future__ import annotations

import glob
import json
import os
import re
import socket
import sys
import threading
import time
from typing import Any, TextIO

from mpi4py import MPI

from mpi_strategy._src.core.process import PROCESS

ENV_VAR = "MPI_STRATEGY_TIMELINE"
_EVENT_NAMES = {
    "MPIAllreduce": "allreduce",
    "MPIAllgather": "all_gather",
    "MPIBroadcast": "broadcast",
    "MPIAlltoall": "alltoall",
}


class Timeline:
    """One rank's trace file: events appended as they happen, flushed at exit."""

    def __init__(self, path: str, rank: int, suffix: str = "") -> None:
        self.path = rank_path(path, rank, suffix)
        self._rank = rank + (_SPAWNED_PID_OFFSET if suffix else 0)  # its row (trace "pid")
        self._lock = threading.Lock()
        self._file: TextIO | None = open(self.path, "w")  # noqa: SIM115 - closed by close()
        self._file.write("[\n")
        self._first = True
        self._comms: set[tuple[int, str]] = set()
        self._write(
            {
                "name": "process_name",
                "ph": "M",
                "pid": self._rank,
                "args": {"name": f"rank {rank}{suffix} ({socket.gethostname()})"},
            }
        )

    def collective(
        self,
        op_name: str,
        comm: tuple[int, str],
        start: float,
        agreed: float,
        end: float,
        nbytes: int,
        tensors: int,
        number: int,
    ) -> None:
        """Records one collective of communicator ``comm`` (a (number, label) pair);
        times from ``time.perf_counter()``."""
        now_us, now = time.time() * 1e6, time.perf_counter()
        begin = now_us - (now - start) * 1e6  # wall clock: comparable across hosts
        if comm not in self._comms:
            self._comms.add(comm)
            self._write(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": self._rank,
                    "tid": comm[0],
                    "args": {"name": comm[1]},
                }
            )
        common = {"pid": self._rank, "tid": comm[0], "ph": "X", "cat": "mpi"}
        self._write(
            dict(
                common,
                name=_EVENT_NAMES.get(op_name, op_name),
                ts=begin,
                dur=(end - start) * 1e6,
                args={"collective": number, "bytes": nbytes, "tensors": tensors},
            )
        )
        self._write(dict(common, name="wait for ranks", ts=begin, dur=(agreed - start) * 1e6))
        self._write(
            dict(
                common, name="transfer", ts=begin + (agreed - start) * 1e6, dur=(end - agreed) * 1e6
            )
        )

    def _write(self, event: dict[str, Any]) -> None:
        with self._lock:
            if self._file is None:
                return
            self._file.write(("" if self._first else ",\n") + json.dumps(event))
            self._first = False

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write("\n]\n")
                self._file.close()
                self._file = None


_SPAWNED_PID_OFFSET = 100_000  # a replacement's row, apart from the original ranks'


def current() -> Timeline | None:
    """This process's timeline if ``MPI_STRATEGY_TIMELINE`` is set, else None."""
    path = os.environ.get(ENV_VAR)
    if not path:
        return None
    timeline = PROCESS.timelines.get(path)
    if not isinstance(timeline, Timeline):
        spawned = MPI.Comm.Get_parent() != MPI.COMM_NULL  # a replacement: its own COMM_WORLD
        timeline = PROCESS.timelines[path] = Timeline(
            path, MPI.COMM_WORLD.Get_rank(), f"-spawned-{os.getpid()}" if spawned else ""
        )
    return timeline


def close_all() -> None:
    """Ends every timeline file this process writes (at the program's end)."""
    for timeline in PROCESS.timelines.values():
        timeline.close()


def rank_path(path: str, rank: int, suffix: str = "") -> str:
    """``trace.json`` -> ``trace.rank3.json``: the file rank 3 writes."""
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{suffix}{ext or '.json'}"


def read_events(path: str) -> list[dict[str, Any]]:
    """The events of a timeline file (one rank's, also cut short by a crash, or merged)."""
    with open(path) as f:
        text = f.read().strip()
    if text.startswith("{"):
        return json.loads(text)["traceEvents"]
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    return json.loads(text)


def merge(path: str) -> str:
    """Merges ``<stem>.rank*.json`` into ``path`` (one file, one row per rank); returns it."""
    stem, ext = os.path.splitext(path)
    pattern = re.compile(
        re.escape(stem) + r"\.rank(\d+)(?:-spawned-\d+)?" + re.escape(ext or ".json") + "$"
    )
    parts = sorted(
        (int(m.group(1)), p)
        for p in glob.glob(f"{glob.escape(stem)}.rank*")
        if (m := pattern.match(p))
    )
    if not parts:
        raise FileNotFoundError(f"no per-rank timeline files {stem}.rank<R>{ext or '.json'}")
    events = [e for _, p in parts for e in read_events(p)]
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(
            "usage: python -m mpi_strategy timeline TRACE.json  (merges the per-rank "
            "files TRACE.rank<R>.json into TRACE.json)",
            file=sys.stderr,
        )
        return 2
    print(merge(argv[0]))
    return 0
