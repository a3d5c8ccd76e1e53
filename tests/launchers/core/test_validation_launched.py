"""core/validation.py, in programs of their own: misuse that a running
test process cannot show (devices per rank, MPI's thread support)."""

import subprocess
import sys

import pytest

from mpi_testing import program
from testing.launch import run_mpiexec


@pytest.mark.single_process
def test_unequal_devices_per_rank_is_an_error_on_every_rank():
    code, out = run_mpiexec(
        2, [sys.executable, program("unequal_devices_per_rank.py")], silence=120
    )
    assert code == 0, out
    assert out.count("number of devices per rank differs between ranks ([1, 2] by rank)") == 2, out


@pytest.mark.single_process
def test_too_little_thread_support_is_explained():
    proc = subprocess.run(
        [sys.executable, program("funneled_thread_level.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "MPI_THREAD_FUNNELED" in proc.stderr, proc.stderr
    assert "MPI_THREAD_SERIALIZED" in proc.stderr, proc.stderr
