"""``python -m mpi_strategy``: the first command to run on a new cluster."""

import sys

import pytest

from mpi_strategy._src.core.launch import run_mpiexec


@pytest.mark.single_process
def test_diagnostics_report_every_rank_and_a_working_collective():
    code, out = run_mpiexec(2, [sys.executable, "-m", "mpi_strategy"], timeout=120)
    assert code == 0, out[-3000:]
    assert "on 2 rank(s)" in out and "RESULT: ok" in out, out[-3000:]
    for rank in (0, 1):
        line = next(l for l in out.splitlines() if f"rank={rank} " in l)
        for field in ("host=", "mpi=", "thread_level=multiple", "tensorflow=", "allreduce=ok"):
            assert field in line, line


# Rank 1 is made to report a wrong sum (and a non-ASCII host name); mpi4py's
# pickle is replaced by one that fails, so any pickled message fails the run.
NO_PICKLES_AND_A_FAILING_RANK = r"""
import runpy, socket, sys
from mpi4py import MPI

def no_pickles(*args, **kwargs):
    raise AssertionError("mpi4py pickled a message")

MPI.pickle.__init__(no_pickles, no_pickles)
rank = MPI.COMM_WORLD.Get_rank()
if rank == 1:
    socket.gethostname = lambda: "h\u00f4st-\u2603"

import mpi_strategy

class OffByOneOnRank1(mpi_strategy.MPIStrategy):
    @property
    def num_replicas_in_sync(self):
        return super().num_replicas_in_sync + (rank == 1)

mpi_strategy.MPIStrategy = OffByOneOnRank1
sys.argv = ["mpi_strategy"]
runpy.run_module("mpi_strategy", run_name="__main__")
"""


@pytest.mark.single_process
def test_diagnostics_send_no_pickles_and_name_the_failing_rank(tmp_path):
    script = tmp_path / "diagnose.py"
    script.write_text(NO_PICKLES_AND_A_FAILING_RANK, encoding="utf-8")
    code, out = run_mpiexec(2, [sys.executable, str(script)], timeout=120,
                            env={"PYTHONIOENCODING": "utf-8"})
    assert code != 0, out[-3000:]
    assert "mpi4py pickled" not in out, out[-3000:]
    assert "RESULT: FAILED on ranks [1]" in out, out[-3000:]
    rank1 = next(l for l in out.splitlines() if "rank=1 " in l)
    assert "host=h\u00f4st-\u2603  " in rank1 and "allreduce=WRONG (3.0)" in rank1, rank1
    assert "allreduce=ok" in next(l for l in out.splitlines() if "rank=0 " in l)
