"""``python -m mpi_strategy``: the first command to run on a new cluster."""

import sys

import pytest

from launch import run_mpiexec


@pytest.mark.single_process
def test_diagnostics_report_every_rank_and_a_working_collective():
    code, out = run_mpiexec(2, [sys.executable, "-m", "mpi_strategy"], timeout=120)
    assert code == 0, out[-3000:]
    assert "on 2 rank(s)" in out and "RESULT: ok" in out, out[-3000:]
    for rank in (0, 1):
        line = next(l for l in out.splitlines() if f"rank={rank} " in l)
        for field in ("host=", "mpi=", "thread_level=multiple", "tensorflow=", "allreduce=ok"):
            assert field in line, line
