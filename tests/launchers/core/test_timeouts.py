"""core/timeouts.py: CommunicationOptions(timeout_seconds=T), a collective that some
rank never reaches.

The program: tests/programs/metric_read_on_rank_0_only.py.
"""

import re
import sys

import pytest

from mpi_testing import program
from testing.launch import run_mpiexec


@pytest.mark.single_process
def test_a_collective_some_ranks_never_reach_fails_after_the_timeout():
    import time

    timeout = 3.0
    code, out = run_mpiexec(
        3, [sys.executable, program("metric_read_on_rank_0_only.py"), str(timeout)], silence=120
    )
    ended = time.time()
    plain = re.sub(r"\[\d+\] ?", "", out)
    assert code != 0, out[-3000:]
    assert re.search(
        r"timeout after 3 s on rank 0 in allreduce of 1 float32 elements \(shapes \(\); "
        r"collective #\d+ of this communicator\): rank\(s\) \[1, 2\] never reached it "
        r"\(the last collective they entered: rank 1: #\d+, rank 2: #\d+\)",
        plain,
    ), out[-3000:]
    started = float(re.search(r"READING at ([\d.]+)", plain).group(1))
    # T, then the abort (1 s grace for the traceback) and the launcher's teardown.
    assert ended - started < timeout + 15, f"ended {ended - started:.1f} s after the read"
