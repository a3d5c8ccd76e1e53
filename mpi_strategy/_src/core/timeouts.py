"""A collective with a timeout: waiting, and naming the ranks that never arrived.

With ``CommunicationOptions(timeout_seconds=T)`` the agreement's exchange is
non-blocking and polled (``wait``), and each rank tells the others (a few
bytes, point to point, ``Announcements``) the number of every collective it
enters. A rank that waited ``T`` seconds then raises an error naming the
collective, its shape and the ranks that never arrived, with the last
collective each of them entered. The native kernels do the same in C
(``native/kernels/timeouts.cc``: the same messages, the same tag, on the same
communicator, into ``Announcements.shared``), so the engines interoperate.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from mpi_strategy._src.core import protocol
from mpi_strategy._src.core.protocol import ANNOUNCE_TAG, as_int64


class Announcements:
    """Which collective each rank of a communicator last entered.

    Collective over ``comm`` when ``enabled`` (and more than one rank): the
    announcements travel on a duplicate of ``comm``, created here and freed
    with this object, so that they never match another message.

    ``shared`` (int64, ``words`` of them; none when disabled), which the
    native kernels read and write too (it follows ``protocol.State`` in the
    agreement's block; ``protocol.announced`` places its parts): the last
    collective each rank entered (``size`` of them), then the kernels'
    outgoing number and their pending send requests (one per rank, 0 for none).
    """

    def __init__(self, comm: MPI.Intracomm, enabled: bool) -> None:
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        self._comm = comm.Dup() if enabled and self._size > 1 else None
        if self._comm is not None:  # freed with this object (not at exit)
            weakref.finalize(self, self._comm.Free).atexit = False
        self._at = protocol.announced(self._size)
        self.words = 0 if self._comm is None else self._at.words
        self.use(np.zeros(self.words, np.int64))
        self._sends: list[tuple[MPI.Request, np.ndarray]] = []

    def use(self, shared: np.ndarray) -> None:
        """Keeps the announcements in ``shared`` (``words`` int64) from now on."""
        self.shared = shared
        at = self._at.last_seen  # (the last collective each rank entered)
        self._last_seen = shared[at : at + self._size]

    def announce(self, seq: int) -> None:
        """Tells every other rank that this rank enters collective ``seq``."""
        if self._comm is None:
            return
        MPI.Request.Waitall([req for req, _ in self._sends])  # small: long since delivered
        number = np.array([seq], np.int64)
        self._sends = [
            (self._comm.Isend([number, MPI.INT64_T], dest=r, tag=ANNOUNCE_TAG), number)
            for r in range(self._size)
            if r != self._rank
        ]
        self._last_seen[self._rank] = seq

    def collect(self) -> None:
        """Reads the announcements that have arrived."""
        if self._comm is None:
            return
        status, seq = MPI.Status(), np.empty(1, np.int64)
        while self._comm.Iprobe(MPI.ANY_SOURCE, ANNOUNCE_TAG, status):
            self._comm.Recv([seq, MPI.INT64_T], source=status.Get_source(), tag=ANNOUNCE_TAG)
            source = status.Get_source()
            self._last_seen[source] = max(self._last_seen[source], seq[0])

    def communicators(self) -> list[MPI.Intracomm]:
        """The announcements' communicator, if any."""
        return [] if self._comm is None else [self._comm]

    @property
    def handle(self) -> int:
        """The MPI handle of the announcements' communicator (0: none)."""
        return 0 if self._comm is None else as_int64(self._comm.handle)

    def missing(self, seq: int) -> str:
        """Which ranks never reached collective ``seq``, in words."""
        if self._comm is None:
            return (
                "some ranks never reached it (which ones is known when the timeout is "
                "set for the whole strategy: MPIStrategy(communication_options="
                "tf.distribute.experimental.CommunicationOptions(timeout_seconds=T)))"
            )
        self.collect()
        missing = [r for r in range(self._size) if self._last_seen[r] < seq]
        last = ", ".join(f"rank {r}: #{self._last_seen[r]}" for r in missing)
        return f"rank(s) {missing} never reached it (the last collective they entered: {last})"


def wait(request: MPI.Request, timeout: float, expired: Callable[[], Exception]) -> None:
    """Waits for ``request``, at most ``timeout`` seconds; then raises ``expired()``."""
    deadline = time.monotonic() + timeout
    pause = 0.0
    while not request.Test():
        if time.monotonic() > deadline:
            raise expired()
        # Poll often at first (most waits are short), then back off to
        # leave the cores to the ranks still computing.
        time.sleep(pause)
        pause = min(2 * pause + 1e-5, 1e-3)
