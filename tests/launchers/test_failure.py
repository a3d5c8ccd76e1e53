"""mpi_strategy.failure: an exception on one rank ends the whole job promptly.

One 2-rank launch per place where a rank can fail: inside a compiled training
step (a ``tf.debugging.Assert`` in the replica function), in the input pipeline
(a ``tf.data`` generator), and between steps (plain Python). In each, only
rank 1 raises; the other rank goes on to its next collective, where it would
wait forever without the abort hook.
"""

import os
import re
import sys
import time

import pytest

from mpi_strategy._src.core.launch import run_mpiexec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEADLINE = 30.0  # seconds from the first completed step to the end of the job

FAIL_ON_RANK_1 = r"""
import sys, time
import numpy as np
import tensorflow as tf
import mpi_strategy

CASE, BAD_STEP = sys.argv[1], 3
strategy = mpi_strategy.MPIStrategy()
rank = strategy.cluster_resolver.task_id


def records():
    for i in range(10**6):
        if CASE == "input" and rank == 1 and i == BAD_STEP * 4:
            raise ValueError(f"corrupt record {i} on rank 1")
        yield np.full([2], i % 7, np.float32)


def dataset_fn(input_context):  # each rank reads its own records
    return tf.data.Dataset.from_generator(
        records, output_signature=tf.TensorSpec([2], tf.float32)).batch(4)


with strategy.scope():
    w = tf.Variable([0.5, -0.5])
    optimizer = tf.keras.optimizers.SGD(0.01)
step = tf.Variable(0, dtype=tf.int64)


@tf.function
def train_step(batch):
    def replica_fn(x):
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        if CASE == "in_step":
            tf.debugging.Assert(tf.logical_or(replica != 1, step < BAD_STEP),
                                ["loss is not finite on replica", replica])
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.reduce_sum(x * w, axis=1) ** 2)
        optimizer.apply_gradients([(tape.gradient(loss, w), w)])
        return loss
    loss = strategy.run(replica_fn, args=(batch,))
    step.assign_add(1)
    return strategy.reduce("SUM", loss, axis=None)


batches = iter(strategy.distribute_datasets_from_function(dataset_fn))
for i in range(100_000):  # the other rank goes on to its next collectives
    train_step(next(batches))
    if i == 0:
        print(f"FIRST_STEP_DONE_AT={time.time():.3f}", flush=True)
    if CASE == "between" and rank == 1 and i == BAD_STEP:
        raise ValueError("bad batch on rank 1")
print("ALL_STEPS_DONE", flush=True)
"""

# case -> (exception summary, lines of the traceback that locate the failure)
CASES = {
    "in_step": ("InvalidArgumentError: Graph execution error",
                ["in replica_fn", "assertion failed: [loss is not finite on replica]"]),
    "input": ("ValueError: corrupt record 12 on rank 1",
              ['raise ValueError(f"corrupt record {i} on rank 1")', "in records"]),
    "between": ("ValueError: bad batch on rank 1",
                ['raise ValueError("bad batch on rank 1")']),
}


@pytest.mark.single_process
@pytest.mark.parametrize("case", sorted(CASES))
def test_an_exception_on_one_rank_ends_the_job_with_its_traceback(tmp_path, case):
    script = tmp_path / "fail_on_rank_1.py"
    script.write_text(FAIL_ON_RANK_1)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    code, out = run_mpiexec(2, [sys.executable, str(script), case], timeout=180, env=env)
    ended = time.time()
    plain = re.sub(r"\[\d+\] ?", "", out)  # MPICH's -prepend-rank tags arbitrary chunks
    started = [float(t) for t in re.findall(r"FIRST_STEP_DONE_AT=([\d.]+)", plain)]
    assert code != 0 and started and "ALL_STEPS_DONE" not in plain, out[-5000:]
    summary, where = CASES[case]
    # The hook's summary line names the rank and the exception.
    assert re.search(r"uncaught exception on rank 1 of 2 \([^\n]*" + re.escape(summary), plain), \
        out[-5000:]
    assert "uncaught exception on rank 0" not in plain, out[-5000:]
    for line in where:
        assert line in plain, f"{line!r} not in the traceback:\n{out[-5000:]}"
    took = ended - min(started)
    assert took < DEADLINE, f"the job took {took:.1f} s to end after its first step:\n{out[-5000:]}"
