"""core/failure.py: an exception on one rank ends the whole job promptly.

One 2-rank launch per place where a rank can fail: inside a compiled training
step (a ``tf.debugging.Assert`` in the replica function), in the input pipeline
(a ``tf.data`` generator), and between steps (plain Python). In each, only
rank 1 raises; the other rank goes on to its next collective, where it would
wait forever without the abort hook. The program: tests/programs/fail_on_rank_1.py.
"""

import os
import re
import sys
import time

import pytest

from mpi_testing import REPO, program
from testing.launch import run_mpiexec

DEADLINE = 30.0  # seconds from the first completed step to the end of the job

# case -> (exception summary, lines of the traceback that locate the failure)
CASES = {
    "in_step": (
        "InvalidArgumentError: Graph execution error",
        ["in replica_fn", "assertion failed: [loss is not finite on replica]"],
    ),
    "input": (
        "ValueError: corrupt record 12 on rank 1",
        ['raise ValueError(f"corrupt record {i} on rank 1")', "in records"],
    ),
    "between": ("ValueError: bad batch on rank 1", ['raise ValueError("bad batch on rank 1")']),
}


@pytest.mark.single_process
@pytest.mark.parametrize("case", sorted(CASES))
def test_an_exception_on_one_rank_ends_the_job_with_its_traceback(case):
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    code, out = run_mpiexec(
        2, [sys.executable, program("fail_on_rank_1.py"), case], silence=180, env=env
    )
    ended = time.time()
    plain = re.sub(r"\[\d+\] ?", "", out)  # MPICH's -prepend-rank tags arbitrary chunks
    started = [float(t) for t in re.findall(r"FIRST_STEP_DONE_AT=([\d.]+)", plain)]
    assert code != 0 and started and "ALL_STEPS_DONE" not in plain, out[-5000:]
    summary, where = CASES[case]
    # The hook's summary line names the rank and the exception.
    assert re.search(r"uncaught exception on rank 1 of 2 \([^\n]*" + re.escape(summary), plain), (
        out[-5000:]
    )
    assert "uncaught exception on rank 0" not in plain, out[-5000:]
    for line in where:
        assert line in plain, f"{line!r} not in the traceback:\n{out[-5000:]}"
    took = ended - min(started)
    assert took < DEADLINE, f"the job took {took:.1f} s to end after its first step:\n{out[-5000:]}"
