"""core/validation.py, in programs of their own: misuse that a running
test process cannot show (devices per rank, MPI's thread support)."""

import sys

import pytest

from mpi_testing import program
from testing.launch import run_launcher, run_mpiexec


@pytest.mark.single_process
def test_unequal_devices_per_rank_is_an_error_on_every_rank():
    code, out = run_mpiexec(
        2, [sys.executable, program("unequal_devices_per_rank.py")], silence=120
    )
    assert code == 0, out
    assert out.count("number of devices per rank differs between ranks ([1, 2] by rank)") == 2, out


@pytest.mark.single_process
def test_too_little_thread_support_is_explained():
    code, out = run_launcher([sys.executable, program("funneled_thread_level.py")], silence=120)
    assert code != 0
    assert "MPI_THREAD_FUNNELED" in out, out
    assert "MPI_THREAD_SERIALIZED" in out, out
