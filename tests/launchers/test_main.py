"""``python -m mpi_strategy`` (mpi_strategy/__main__.py): the first command to run on a
new cluster."""

import sys

import pytest

from mpi_testing import program
from testing.launch import run_mpiexec


@pytest.mark.single_process
def test_diagnostics_report_every_rank_and_a_working_collective():
    code, out = run_mpiexec(2, [sys.executable, "-m", "mpi_strategy"], silence=120)
    assert code == 0, out[-3000:]
    assert "on 2 rank(s)" in out and "RESULT: ok" in out, out[-3000:]
    for rank in (0, 1):
        line = next(s for s in out.splitlines() if f"rank={rank} " in s)
        fields = (
            "host=",
            "mpi=",
            "thread_level=multiple",
            "tensorflow=",
            "kernels=",
            "allreduce=ok",
        )
        for field in fields:
            assert field in line, line


# Rank 1 is made to report a wrong sum (and a non-ASCII host name); mpi4py's
# pickle is replaced by one that fails, so any pickled message fails the run
# (tests/programs/diagnostics_without_pickles.py).
@pytest.mark.single_process
def test_diagnostics_send_no_pickles_and_name_the_failing_rank():
    code, out = run_mpiexec(
        2,
        [sys.executable, program("diagnostics_without_pickles.py")],
        silence=120,
        env={"PYTHONIOENCODING": "utf-8"},
    )
    assert code != 0, out[-3000:]
    assert "mpi4py pickled" not in out, out[-3000:]
    assert "RESULT: FAILED on ranks [1]" in out, out[-3000:]
    rank1 = next(s for s in out.splitlines() if "rank=1 " in s)
    assert "host=h\u00f4st-\u2603  " in rank1 and "allreduce=WRONG (3.0)" in rank1, rank1
    assert "allreduce=ok" in next(s for s in out.splitlines() if "rank=0 " in s)
