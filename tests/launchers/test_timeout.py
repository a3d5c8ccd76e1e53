"""CommunicationOptions(timeout_seconds=T): a collective that some rank never reaches."""

import re
import sys

import pytest

from mpi_strategy._src.core.launch import run_mpiexec

METRIC_READ_ON_RANK_0_ONLY = r"""
import sys, time
import tensorflow as tf
import keras
import mpi_strategy

timeout = float(sys.argv[1])
strategy = mpi_strategy.MPIStrategy(
    communication_options=tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=timeout))
with strategy.scope():
    loss_metric = keras.metrics.Mean()

@tf.function
def step():
    def replica_fn():
        loss_metric.update_state(1.0)
        return tf.constant(1.0)
    return strategy.reduce("SUM", strategy.run(replica_fn), axis=None)

for _ in range(3):
    step()
if strategy.cluster_resolver.task_id == 0:
    print(f"READING at {time.time():.3f}", flush=True)
    print("loss", float(loss_metric.result()))  # a collective: the other ranks never come
else:
    time.sleep(120)  # e.g. busy writing something else; no collective
"""


@pytest.mark.single_process
def test_a_collective_some_ranks_never_reach_fails_after_the_timeout(tmp_path):
    import time
    script = tmp_path / "metric_on_rank0.py"
    script.write_text(METRIC_READ_ON_RANK_0_ONLY)
    timeout = 3.0
    code, out = run_mpiexec(3, [sys.executable, str(script), str(timeout)], timeout=120)
    ended = time.time()
    plain = re.sub(r"\[\d+\] ?", "", out)
    assert code != 0, out[-3000:]
    assert re.search(
        r"timeout after 3 s on rank 0 in allreduce of 1 float32 elements \(shapes \(\); "
        r"collective #\d+ of this communicator\): rank\(s\) \[1, 2\] never reached it "
        r"\(the last collective they entered: rank 1: #\d+, rank 2: #\d+\)", plain), out[-3000:]
    started = float(re.search(r"READING at ([\d.]+)", plain).group(1))
    # T, then the abort (1 s grace for the traceback) and the launcher's teardown.
    assert ended - started < timeout + 15, f"ended {ended - started:.1f} s after the read"
