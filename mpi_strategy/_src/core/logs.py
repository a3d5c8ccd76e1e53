"""The library's log: every line tagged with the rank, ranks other than 0 quiet.

mpi_strategy logs to the standard ``logging`` logger ``"mpi_strategy"``, each
line prefixed ``[mpi_strategy rank R/N]``. Rank 0 shows INFO and above; the
other ranks only errors, so N ranks do not print N copies of the same line.
Change it like any logger: ``logging.getLogger("mpi_strategy").setLevel(...)``.
"""

from __future__ import annotations

import logging
import sys

from mpi4py import MPI

logger = logging.getLogger("mpi_strategy")


class _RankTaggedHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The library's own handler (tells it from any the program adds)."""


def configure() -> None:
    """Installs the rank-tagged handler once per process (``effects.install``)."""
    if any(isinstance(h, _RankTaggedHandler) for h in logger.handlers):
        return
    logger.addHandler(_RankTaggedHandler(sys.stderr))
    logger.propagate = False  # one line per message, not one more via the root logger
    set_rank(MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
    if MPI.Comm.Get_parent() != MPI.COMM_NULL:
        logger.setLevel(logging.ERROR)  # a replacement of a lost rank: quiet until it joins


def set_rank(rank: int, size: int) -> None:
    """Tags lines with ``rank``/``size`` and lets only rank 0 say more than errors
    (called again when ranks were lost and the survivors renumbered)."""
    for handler in logger.handlers:
        if isinstance(handler, _RankTaggedHandler):
            handler.setFormatter(
                logging.Formatter(f"[mpi_strategy rank {rank}/{size}] %(levelname)s: %(message)s")
            )
    logger.setLevel(logging.INFO if rank == 0 else logging.ERROR)
