"""User-Level Failure Mitigation (Open MPI 5's ``--with-ft ulfm``): how a lost
rank is seen, and the few ULFM calls the library makes.

Only an MPI with ULFM reports a process failure; elsewhere (MPICH 5) a lost
rank ends the job, as without elastic mode.
"""

from __future__ import annotations

import ctypes
import os
from typing import cast

from mpi4py import MPI

# MPI error classes of a process failure. Only an MPI with User-Level Failure
# Mitigation reports them; elsewhere (MPICH 5) the three are one placeholder.
_ULFM = (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED)
_FAILURE_CLASSES = frozenset(_ULFM) if len(set(_ULFM)) == 3 else frozenset()


def ulfm_launch() -> bool:
    """True under Open MPI launched with ``--with-ft ulfm`` (which sets the MCA
    parameter mpi_ft_enable for every rank)."""
    return (
        "Open MPI" in MPI.Get_library_version()
        # (Open MPI's name for the parameter, in lower case)
        and os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower()  # noqa: SIM112
        in ("1", "true", "enabled")
    )


def is_process_failure(error: BaseException) -> bool:
    """True for an ``MPI.Exception`` saying that a rank died (ULFM)."""
    return isinstance(error, MPI.Exception) and error.Get_error_class() in _FAILURE_CLASSES


def is_replacement() -> bool:
    """True in a process that ``elastic.run(replace_lost=True)`` started to
    replace a lost rank (it has a parent job)."""
    return MPI.Comm.Get_parent() != MPI.COMM_NULL


def revoke(comm: MPI.Comm) -> None:
    """Revokes ``comm``: every rank in (or entering) one of its calls fails.
    A communicator that another rank already revoked, or that a failure
    made unusable, fails the call: that is the state asked for."""
    try:
        comm.Revoke()
    except MPI.Exception as error:
        if not is_process_failure(error):
            raise


def shrink(comm: MPI.Intracomm) -> MPI.Intracomm:
    """The living ranks of ``comm`` (revoked), agreed on by all of them."""
    while True:
        revoke(comm)
        # (Shrink returns the communicator's own class; mpi4py's stub says Comm)
        survivors = cast(MPI.Intracomm, comm.Shrink())
        try:
            survivors.Agree(1)  # fails if another rank died meanwhile
            return survivors
        except MPI.Exception as error:
            if not is_process_failure(error):
                raise
            comm = survivors


def all_agree(comm: MPI.Intracomm, mine: bool) -> bool:
    """ULFM's agreement: True on every living rank of ``comm`` if each of them
    passed True and none died meanwhile, else False on every one."""
    try:
        return bool(comm.Agree(int(mine)))
    except MPI.Exception as error:
        if not is_process_failure(error):
            raise
        return False


def known_dead(comm: MPI.Comm) -> set[int]:
    """The ranks of ``comm`` that this process knows dead (ULFM), without
    waiting for any other rank. Failure notices reach the library only while
    MPI progresses: a probe of ``COMM_SELF`` first lets it."""
    MPI.COMM_SELF.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
    failed, group = comm.Get_failed(), comm.Get_group()
    try:
        return set(MPI.Group.Translate_ranks(failed, range(failed.Get_size()), group))
    finally:
        failed.Free()
        group.Free()


def meet_the_living(comm: MPI.Intracomm) -> bool:
    """ULFM's agreement: returns on every living rank; False where it saw a
    rank of ``comm`` dead."""
    try:
        comm.Agree(1)
        return True
    except MPI.Exception as error:
        if not is_process_failure(error):
            raise
        return False  # a rank died at the very end: nothing left to wait for


# Open MPI 5's variable behind its MCA parameter async_mpi_finalize (read-only
# once MPI is initialized, so MPI_T cannot set it): when true, MPI_Finalize
# skips its barrier of every rank. A private symbol of Open MPI, exported by
# libmpi since 2.0; looked up by name, and left alone where it is not found.
_FINALIZE_WITHOUT_BARRIER = "ompi_async_mpi_finalize"


def finalize_without_barrier() -> None:
    """Makes this process's MPI_Finalize skip Open MPI's barrier of all ranks
    (Open MPI 5 only; elsewhere nothing). For the end of an elastic run,
    once ULFM's agreement showed every rank done: a rank killed while the others
    wait in that barrier can leave them waiting forever (Open MPI 5.0.x under
    ULFM, 4 of 20 launches when two of four ranks die within 10 ms of it)."""
    if not MPI.Get_library_version().startswith("Open MPI v5."):
        return
    library = _loaded_library("libmpi.so")
    try:
        flag = ctypes.c_bool.in_dll(ctypes.CDLL(library), _FINALIZE_WITHOUT_BARRIER)
    except (OSError, TypeError, ValueError):
        return
    flag.value = True


def _loaded_library(prefix: str) -> str | None:
    """The path of the shared library this process mapped whose file name
    starts with ``prefix`` (the one mpi4py loaded), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if len(line.split()) == 6}
    except OSError:  # (not Linux)
        return None
    return next((p for p in sorted(paths) if os.path.basename(p).startswith(prefix)), None)
