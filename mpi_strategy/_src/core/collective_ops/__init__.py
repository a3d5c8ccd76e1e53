"""The registry of collectives: one module each (its kind, its numpy
implementation, its agreement's tag and shapes, its native op), in the order
of ``OrderedComm``'s verbs. To add a collective: its module here, its entry
in ``ALL``, its kernel in ``native/kernels/<name>.cc`` (optional) and its
verb in ``distribute/ordered_comm.py`` (docs/contributing.md)."""

from __future__ import annotations

from mpi_strategy._src.core.collective_ops.allgather import ALLGATHER
from mpi_strategy._src.core.collective_ops.allreduce import ALLREDUCE
from mpi_strategy._src.core.collective_ops.alltoall import ALLTOALL
from mpi_strategy._src.core.collective_ops.alltoallv import ALLTOALLV
from mpi_strategy._src.core.collective_ops.barrier import BARRIER
from mpi_strategy._src.core.collective_ops.base import CollectiveOp
from mpi_strategy._src.core.collective_ops.broadcast import BROADCAST
from mpi_strategy._src.core.collective_ops.reducescatter import REDUCESCATTER

ALL = (ALLREDUCE, BROADCAST, ALLGATHER, ALLTOALL, REDUCESCATTER, BARRIER, ALLTOALLV)


def get(name: str) -> CollectiveOp:
    """The collective called ``name`` (``engines.Collective.kind``); raises
    ``ValueError`` for a name no module of this package declares (asked when
    tracing, alike on every rank)."""
    for spec in ALL:
        if spec.name == name:
            return spec
    raise ValueError(
        f"mpi_strategy: no collective kind {name!r} (known: {', '.join(c.name for c in ALL)})"
    )


__all__ = [
    "ALL",
    "ALLGATHER",
    "ALLREDUCE",
    "ALLTOALL",
    "ALLTOALLV",
    "BARRIER",
    "BROADCAST",
    "REDUCESCATTER",
    "CollectiveOp",
    "get",
]
