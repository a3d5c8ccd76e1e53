"""mpi_strategy.failure: an exception on one rank ends the whole job promptly."""

import re
import sys
import time

import pytest

from launch import run_mpiexec

RAISE_ON_RANK_1 = r"""
import tensorflow as tf
import mpi_strategy
strategy = mpi_strategy.MPIStrategy()

@tf.function
def step():
    return strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)

step()
if strategy.cluster_resolver.task_id == 1:
    raise ValueError("bad batch on rank 1")
for _ in range(1000):  # the other ranks go on to their next collectives
    step()
"""


@pytest.mark.single_process
def test_an_exception_on_one_rank_ends_the_job_with_its_traceback(tmp_path):
    script = tmp_path / "raise_on_rank_1.py"
    script.write_text(RAISE_ON_RANK_1)
    start = time.monotonic()
    code, out = run_mpiexec(3, [sys.executable, str(script)], timeout=120)
    elapsed = time.monotonic() - start
    assert code != 0
    plain = re.sub(r"\[\d+\] ?", "", out)  # MPICH's -prepend-rank tags arbitrary chunks
    assert "uncaught exception on rank 1 of 3 (ValueError: bad batch on rank 1)" in plain, out[-3000:]
    assert 'raise ValueError("bad batch on rank 1")' in plain, out[-3000:]  # the traceback
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"  # TF start-up included
