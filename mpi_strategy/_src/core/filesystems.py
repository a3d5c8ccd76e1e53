"""Which ranks see the same files: one writer per filesystem.

A save that every rank makes is written by one rank per copy of the
directory: rank 0 when every rank sees it (a shared filesystem), else the
lowest rank of the nodes that see the same files there (node-local disks),
found once per directory by probe files that each node's lowest rank creates.
"""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np
from mpi4py import MPI

_PROBE_SECONDS = 1.0  # how long a rank looks for another's probe file (NFS caches lookups)


class Topology:
    """The nodes and filesystems of the ranks of ``comm`` (its methods are collective)."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self._comm = comm
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        self._leader_of: list[int] | None = None
        self._writers: dict[str, int] = {}

    def writer_rank(self, path: str) -> int:
        """The rank that writes ``path`` for this rank's filesystem (collective).

        Rank 0 on a filesystem every rank sees (and for remote URLs); on
        node-local disks, the lowest rank of each node that sees the same
        directory. Ranks of one node are taken to share their filesystems.
        """
        if "://" in path:
            return 0
        leader_of = self.node_leaders()
        if len(set(leader_of)) == 1:
            return 0
        directory = os.path.dirname(os.path.normpath(path)) or "."
        if directory not in self._writers:
            self._writers[directory] = _probe(self._comm, directory, leader_of)
        return self._writers[directory]

    def node_leaders(self) -> list[int]:
        """For every rank, the lowest rank of its node (MPI's shared-memory domain)."""
        if self._leader_of is None:
            node = self._comm.Split_type(MPI.COMM_TYPE_SHARED)
            try:
                leader = np.array([self._rank], np.int64)
                node.Bcast(leader, root=0)
            finally:
                node.Free()
            everyone = np.empty(self._size, np.int64)
            self._comm.Allgather(leader, everyone)
            self._leader_of = everyone.tolist()
        return self._leader_of


def _probe(comm: MPI.Intracomm, directory: str, leader_of: list[int]) -> int:
    """The writer for this rank's copy of ``directory``: the lowest rank of the
    nodes that see the same files there (each node's leader creates a probe
    file; two nodes share a filesystem if either sees the other's)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    token = np.frombuffer(os.urandom(8), np.uint8).copy()
    comm.Bcast(token, root=0)
    mine = ""
    if leader_of[rank] == rank:
        try:
            existing = _nearest_existing(os.path.abspath(directory))
            mine = os.path.join(existing, f".mpi_strategy-probe-{token.tobytes().hex()}-{rank}")
            open(mine, "w").close()
        except (OSError, ValueError):
            mine = ""  # not writable here: the save itself will say so, on every rank
    probes = allgather_text(comm, mine)
    seen = np.zeros(size, np.int8)
    seen[leader_of[rank]] = 1
    seen[_visible({r: p for r, p in enumerate(probes) if p and r != leader_of[rank]})] = 1
    everyone = np.empty((size, size), np.int8)
    comm.Allgather(seen, everyone)
    comm.Barrier()
    if mine:
        # only a probe: a leftover empty file is harmless, the save goes on
        with contextlib.suppress(OSError):
            os.remove(mine)
    return min(_same_filesystem(everyone, leader_of, rank))


def _same_filesystem(seen: np.ndarray, leader_of: list[int], rank: int) -> set[int]:
    """The ranks connected to ``rank`` by "saw the probe of the other's node"."""
    linked = (seen | seen.T).astype(bool)
    group, todo = {rank}, [rank]
    while todo:
        r = todo.pop()
        for other in [*np.flatnonzero(linked[r] | linked[:, leader_of[r]]).tolist(), leader_of[r]]:
            if other not in group:
                group.add(other)
                todo.append(other)
    return group


def allgather_text(comm: MPI.Intracomm, text: str) -> list[str]:
    """Every rank's ``text``, in rank order, as bytes on the wire (no pickles)."""
    data = np.frombuffer(os.fsencode(text), np.uint8)
    counts = np.empty(comm.Get_size(), np.int64)
    comm.Allgather(np.array([data.size], np.int64), counts)
    received = np.empty(int(counts.sum()), np.uint8)
    comm.Allgatherv(data, [received, (counts.tolist(), None), MPI.BYTE])
    offsets = np.concatenate([[0], np.cumsum(counts)])
    return [os.fsdecode(bytes(received[offsets[r] : offsets[r + 1]])) for r in range(len(counts))]


def _nearest_existing(directory: str) -> str:
    while not os.path.isdir(directory):
        directory = os.path.dirname(directory)
    return directory


def _visible(probes: dict[int, str]) -> list[int]:
    """The ranks (keys) whose probe file (value) this rank can open, waiting up
    to _PROBE_SECONDS for all of them (NFS may cache a file's absence)."""
    deadline = time.monotonic() + _PROBE_SECONDS
    seen = []
    while True:
        for directory in {os.path.dirname(p) for p in probes.values()}:
            # gone or unreadable: the probe inside is then not visible
            with contextlib.suppress(OSError):
                os.listdir(directory)  # makes NFS look again
        for r, probe in list(probes.items()):
            if os.path.exists(probe) and _opens(probe):
                seen.append(r)
                del probes[r]
        if not probes or time.monotonic() >= deadline:
            return seen
        time.sleep(0.05)


def _opens(path: str) -> bool:
    try:
        with open(path):
            return True
    except OSError:
        return False
