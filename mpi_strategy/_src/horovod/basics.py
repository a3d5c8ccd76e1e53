"""Horovod's process model on MPI: ``init``, ranks and sizes, process sets.

Horovod's global process set is the communicator given to ``init`` (default
``COMM_WORLD``); each process set is a sub-communicator with its own
``OrderedComm``, so its collectives are ordered, checked and timed like
MPIStrategy's. A node is a shared-memory split of the global communicator
(``local_rank``); ``cross_rank`` numbers the nodes.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mpi4py import MPI

from mpi_strategy._src.core import failure, timeline as timeline_lib
from mpi_strategy._src.core.process import PROCESS
from mpi_strategy._src.distribute import strategy as strategy_lib
from mpi_strategy._src.distribute.ordered_comm import OrderedComm
from mpi_strategy._src.horovod.exceptions import MismatchError, StalledError


class ProcessSet:
    """A subset of the global process set's ranks, with collectives of its own.

    ``ProcessSet([0, 2])`` or ``ProcessSet(comm)`` (an mpi4py communicator
    that is a subset of the global one). Every rank of the global set calls
    ``add_process_set`` (or ``init(process_sets=...)``) with the same sets, in
    the same order; collectives on a set are then made by its ranks only.
    """

    def __init__(self, ranks_or_comm: Sequence[int] | MPI.Intracomm) -> None:
        self.process_set_id: int | None = None
        self.mpi_comm: MPI.Intracomm | None = None
        if isinstance(ranks_or_comm, MPI.Comm):
            self.mpi_comm = ranks_or_comm
            self.ranks: list[int] | None = None
        else:
            self.ranks = sorted(int(r) for r in ranks_or_comm)
        self.ordered: OrderedComm | None = None  # on the ranks of the set, once added

    def _require(self) -> None:
        if self.process_set_id is None:
            raise ValueError(
                f"{self} has not been added: call hvd.add_process_set() (on every rank) "
                "or pass it to hvd.init(process_sets=[...])"
            )

    def size(self) -> int:
        """How many ranks the set has (the same on every rank)."""
        self._require()
        return len(self.ranks or [])

    def rank(self) -> int:
        """This process's rank within the set (-1 if it is not in the set)."""
        self._require()
        return self.ranks.index(rank()) if self.ranks and rank() in self.ranks else -1

    def included(self) -> bool:
        """Whether this process belongs to the set."""
        self._require()
        return rank() in (self.ranks or [])

    def comm(self) -> OrderedComm:
        """The set's ordered collectives (this rank must be in the set)."""
        self._require()
        if self.ordered is None:
            raise ValueError(f"rank {rank()} is not in {self} and cannot use its collectives")
        return self.ordered

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


@dataclass
class HorovodState:
    """Horovod's API in this process (``PROCESS.of``): its communicators once
    ``init`` ran, the process sets by id, and the HOROVOD_* variables warned about."""

    comm: MPI.Intracomm | None = None
    local: MPI.Comm | None = None
    cross: MPI.Comm | None = None
    sets: dict[int, ProcessSet] = field(default_factory=dict)
    next_id: int = 1
    warned: set[str] = field(default_factory=set)

    def reset(self, **fields: Any) -> None:
        """Sets ``comm``, ``local``, ``cross`` and ``sets`` (others unchanged)."""
        for name, value in fields.items():
            setattr(self, name, value)


def _state() -> HorovodState:
    return PROCESS.of(HorovodState)


def init(
    comm: MPI.Intracomm | Sequence[int] | None = None,
    process_sets: Sequence[ProcessSet] | str | None = None,
) -> None:
    """Starts Horovod's API on ``comm`` (default ``COMM_WORLD``; a list of
    ranks of COMM_WORLD also works). Collective over ``COMM_WORLD`` the
    first time; later calls do nothing, as in Horovod. ``process_sets``:
    sets to add now (``"dynamic"``: add them later, always allowed here)."""
    if _state().comm is not None:
        return
    comm = _communicator(comm)
    _state().comm = comm
    failure.arm(comm)  # an uncaught exception on one rank ends the job, not a hang
    strategy_lib.face_started()  # (the hook that does so is installed then)
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    _state().local = local
    _state().cross = comm.Split(local.Get_rank(), comm.Get_rank())
    global_process_set.ranks = list(range(comm.Get_size()))
    global_process_set.mpi_comm = comm
    global_process_set.ordered = _ordered(comm)
    _state().sets = {0: global_process_set}
    _environment()
    if isinstance(process_sets, (list, tuple)):
        for process_set in process_sets:
            add_process_set(process_set)


def _communicator(comm: MPI.Intracomm | Sequence[int] | None) -> MPI.Intracomm:
    """``init``'s argument as a communicator (a list names ranks of COMM_WORLD)."""
    if comm is None:
        return MPI.COMM_WORLD
    if isinstance(comm, MPI.Intracomm):
        return comm
    ranks = sorted(int(r) for r in comm)
    created = MPI.Intracomm(MPI.COMM_WORLD.Create(MPI.COMM_WORLD.Get_group().Incl(ranks)))
    if created == MPI.COMM_NULL:
        raise ValueError(f"hvd.init({ranks}): rank {MPI.COMM_WORLD.Get_rank()} is not listed")
    return created


def _ordered(comm: MPI.Intracomm) -> OrderedComm:
    return OrderedComm(comm, mismatch_error=MismatchError, timeout_error=StalledError)


def continue_on(comm: MPI.Intracomm) -> None:
    """Makes the global process set span ``comm`` from now on (elastic
    training: the survivors after ranks were lost). Collective over ``comm``.
    ``rank()``, ``size()``, the local and cross ranks and the global set's
    collectives follow ``comm``; the other process sets are removed (their
    ranks are gone): every rank adds again those it needs. Functions traced
    before hold the old collectives and must be traced again."""
    check_initialized("continue_on")
    for process_set in list(_state().sets.values())[1:]:
        remove_process_set(process_set)
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    cross = comm.Split(local.Get_rank(), comm.Get_rank())
    _state().reset(comm=comm, local=local, cross=cross, sets={0: global_process_set})
    global_process_set.ranks = list(range(comm.Get_size()))
    global_process_set.mpi_comm = comm
    global_process_set.ordered = _ordered(comm)


def shutdown() -> None:
    """Ends Horovod's API (MPI itself ends with the program); ``init`` may follow."""
    for process_set in list(_state().sets.values())[1:]:
        remove_process_set(process_set)
    _state().reset(comm=None, local=None, cross=None, sets={})
    global_process_set.ordered = None


def is_initialized() -> bool:
    """Whether ``init`` ran (and ``shutdown`` did not follow)."""
    return _state().comm is not None


def _comm(name: str = "comm") -> MPI.Intracomm:
    comm = getattr(_state(), name)
    if comm is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return comm


def rank() -> int:
    """This process's rank in the global process set."""
    return int(_comm().Get_rank())


def size() -> int:
    """The number of processes in the global process set."""
    return int(_comm().Get_size())


def local_rank() -> int:
    """This process's rank among the processes of its node."""
    return int(_comm("local").Get_rank())


def local_size() -> int:
    """The number of processes on this process's node."""
    return int(_comm("local").Get_size())


def cross_rank() -> int:
    """The number of this process's node (among nodes holding its local rank)."""
    return int(_comm("cross").Get_rank())


def cross_size() -> int:
    """The number of nodes that hold a process of this local rank."""
    return int(_comm("cross").Get_size())


def is_homogeneous() -> bool:
    """Whether every node runs as many processes (collective over the global set)."""
    sizes = _comm().allgather(local_size())
    return len(set(sizes)) == 1


def mpi_threads_supported() -> bool:
    """Whether MPI was initialized with MPI_THREAD_MULTIPLE."""
    _comm()
    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)


def mpi_enabled() -> bool:
    """Always True: MPI is the only controller here."""
    return True


def mpi_built(verbose: bool = False) -> bool:
    """Always True."""
    return True


def gloo_enabled() -> bool:
    """Always False: no Gloo here."""
    return False


def gloo_built(verbose: bool = False) -> bool:
    """Always False."""
    return False


def nccl_built(verbose: bool = False) -> int:
    """0: no NCCL (no GPU collectives yet)."""
    return 0


def ddl_built(verbose: bool = False) -> bool:
    """False."""
    return False


def ccl_built(verbose: bool = False) -> bool:
    """False."""
    return False


def cuda_built(verbose: bool = False) -> bool:
    """False."""
    return False


def rocm_built(verbose: bool = False) -> bool:
    """False."""
    return False


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Adds a process set; every rank of the global set calls it, with the
    same ranks, in the same order. Returns the set, now with an id."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    comm = _comm()
    if process_set.mpi_comm is not None:
        member = process_set.mpi_comm != MPI.COMM_NULL
        ranks = comm.allgather(comm.Get_rank() if member else None)
        process_set.ranks = [r for r in ranks if r is not None]
    everyone = comm.allgather(process_set.ranks)
    if any(ranks != everyone[0] for ranks in everyone):
        raise ValueError(f"hvd.add_process_set: the ranks disagree on the set: {everyone}")
    ranks = everyone[0] or []
    if not ranks or any(not 0 <= r < comm.Get_size() for r in ranks):
        raise ValueError(f"hvd.add_process_set: invalid ranks {ranks} (size {comm.Get_size()})")
    for existing in _state().sets.values():
        if existing.ranks == ranks:
            raise ValueError(f"hvd.add_process_set: {existing} has the same ranks")
    member = comm.Get_rank() in ranks
    sub = MPI.Intracomm(comm.Split(0 if member else MPI.UNDEFINED, comm.Get_rank()))
    process_set.ranks = ranks
    process_set.process_set_id = _state().next_id
    _state().next_id += 1
    process_set.ordered = _ordered(sub) if member else None
    _state().sets[process_set.process_set_id] = process_set
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Removes a process set added before (every rank calls it); False if unknown."""
    if process_set.process_set_id in (None, 0) or (
        _state().sets.get(process_set.process_set_id) is not process_set
    ):
        return False
    del _state().sets[process_set.process_set_id]
    process_set.process_set_id = None
    process_set.ordered = None
    return True


def process_set_by_id(process_set_id: int) -> ProcessSet:
    """The added process set with this id."""
    try:
        return _state().sets[process_set_id]
    except KeyError:
        raise ValueError(f"no process set with id {process_set_id}") from None


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Starts recording every collective of this process to ``file_path``
    (one file per rank, ``trace.rank<r>.json``; merge them with
    ``python -m mpi_strategy timeline file_path``)."""
    _comm()
    os.environ[timeline_lib.ENV_VAR] = file_path


def stop_timeline() -> None:
    """Stops the timeline started by ``start_timeline`` (or HOROVOD_TIMELINE)."""
    os.environ.pop(timeline_lib.ENV_VAR, None)
    timeline_lib.close_all()


# -- environment knobs ---------------------------------------------------------
# Horovod's variables that mean something here, and how.
HONOURED = {
    "HOROVOD_TIMELINE": "the library's timeline (MPI_STRATEGY_TIMELINE), one file per rank",
}
# Variables with no effect here: ordering is by program order, fusion is per
# call (grouped_allreduce / DistributedGradientTape fuse a whole step).
IGNORED_PREFIX = "HOROVOD_"
_ALWAYS_SILENT = {"HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"}


def _environment() -> None:
    """Honours HOROVOD_TIMELINE; warns once (rank 0) about each other HOROVOD_* variable."""
    timeline = os.environ.get("HOROVOD_TIMELINE")
    if timeline and not os.environ.get(timeline_lib.ENV_VAR):
        os.environ[timeline_lib.ENV_VAR] = timeline
    ignored = sorted(
        name
        for name in os.environ
        if name.startswith(IGNORED_PREFIX)
        and name not in HONOURED
        and name not in _ALWAYS_SILENT
        and name not in _state().warned
    )
    _state().warned.update(ignored)
    if ignored and rank() == 0:
        warnings.warn(
            f"mpi_strategy.horovod ignores {', '.join(ignored)}: collectives here are "
            "ordered by program order and fused per call (grouped_allreduce, "
            "DistributedGradientTape), with no background cycle or fusion buffer to tune.",
            stacklevel=3,
        )


def check_initialized(what: str) -> None:
    """Raises Horovod's error for a call made before ``init``."""
    if _state().comm is None:
        raise ValueError(f"Horovod has not been initialized; use hvd.init() before {what}.")
