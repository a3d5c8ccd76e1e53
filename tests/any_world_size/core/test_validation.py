"""core/validation.py: misuse is reported clearly, on every rank.

Misuse that needs a program of its own: tests/launchers/core/test_validation_launched.py.
"""

import pytest
from mpi4py import MPI

from mpi_strategy._src.core.validation import check_same_on_all_ranks, resolve_comm
from mpi_strategy.errors import MPIStrategyError
from mpi_testing import RANK, SIZE, WORLD


def test_resolve_comm_defaults_to_world_and_rejects_others():
    assert resolve_comm(None) is MPI.COMM_WORLD
    with pytest.raises(TypeError, match="intracommunicator"):
        resolve_comm(object())
    with pytest.raises(ValueError, match="COMM_NULL"):
        resolve_comm(MPI.COMM_NULL)


def test_check_same_on_all_ranks_raises_everywhere_on_disagreement():
    check_same_on_all_ranks(WORLD, 7, "thing")
    if SIZE == 1:
        return
    with pytest.raises(MPIStrategyError, match=r"number of devices per rank differs between ranks"):
        check_same_on_all_ranks(WORLD, RANK, "number of devices per rank")


@pytest.mark.parametrize("variable", ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"])
def test_a_launcher_that_does_not_match_mpi_is_explained(variable, monkeypatch):
    """A launcher started 4 tasks but each one is a world of 1: never train silently alone."""
    import mpi_strategy

    if SIZE > 1:
        pytest.skip("only a world of one process can be a mismatched launch")
    monkeypatch.setenv(variable, "4")
    with pytest.raises(
        MPIStrategyError,
        match=rf"one of 4 tasks started by .*\({variable}=4\), "
        r"but MPI sees a world of 1 process",
    ):
        mpi_strategy.MPIStrategy()
    # comm=COMM_SELF says "independent runs on purpose".
    mpi_strategy.MPIStrategy(comm=MPI.COMM_SELF)
