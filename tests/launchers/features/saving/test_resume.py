"""Kill one rank mid-training, relaunch: training resumes and loses nothing
(features/saving/: checkpoints saved by every rank, written once, restored
everywhere).

A 2-rank job is killed (SIGKILL of rank 1, at a step chosen at random by the
test and printed) and relaunched with the same command. The relaunched job
resumes from the last checkpoint and ends with exactly the weights of a run
that was never interrupted. Two ways of resuming are checked:

* a custom loop with ``tf.train.CheckpointManager`` (saved on every rank,
  written by rank 0, restored by every rank). The input position is not
  checkpointed: the pipeline is a function of the global step
  (``skip(step * global_batch)`` of one fixed stream, then shard), so it
  resumes at the right example at any world size;
* Keras 3 ``fit`` with ``BackupAndRestore(save_freq="epoch")``, which resumes
  at the start of the epoch in which the job died, from the weights and
  optimizer state of the end of the previous epoch (the input restarts with
  the epoch). Keras 3.15 cannot resume mid-epoch: with ``save_freq=<steps>``
  it records the batch but restarts that epoch from batch 0 with mid-epoch
  weights, training on some batches twice. The kill lands mid-epoch, never on
  an epoch's last batch: rank 0 may then be rewriting the backup in place
  when rank 1 dies, and a torn backup is Keras' problem, not this test's.

Both killed launches also show that a SIGKILLed rank ends the whole job
promptly (MPICH's launcher kills the other ranks).

Three launches: [custom killed], [custom resumed, custom uninterrupted, Keras
killed], [Keras resumed, Keras uninterrupted]. The uninterrupted reference runs
in the same kind of 2-rank job; weights must agree within 1e-6. The job:
tests/programs/resume_job.py.
"""

import os
import random
import re
import sys
import time

import numpy as np
import pytest

from mpi_testing import REPO, program, reports, saved_weights
from testing.launch import is_open_mpi, run_mpiexec

# Custom loop: STEPS steps, a checkpoint every CKPT_EVERY steps.
STEPS, CKPT_EVERY = 12, 3
# Keras: EPOCHS epochs of BATCHES_PER_EPOCH batches.
EPOCHS, BATCHES_PER_EPOCH = 4, 5
KILL_DEADLINE = 30.0  # seconds from the kill to the end of the job


def _launch(workdir, runs, expect_kill):
    argv = [
        sys.executable,
        program("resume_job.py"),
        str(workdir),
        str(STEPS),
        str(CKPT_EVERY),
        str(EPOCHS),
        str(BATCHES_PER_EPOCH),
        *runs,
    ]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    started = time.time()
    code, out = run_mpiexec(2, argv, silence=180, env=env)
    ended = time.time()
    print(f"launch {runs}: {ended - started:.1f} s")
    found = reports(out)
    if not expect_kill:
        assert code == 0, out[-5000:]
        return found, out
    kills = [r for r in found if r["event"] == "kill"]
    assert code != 0 and len(kills) == 1, out[-5000:]
    took = ended - kills[0]["time"]
    # A rank killed by a signal ends the job: MPICH's hydra kills the other
    # ranks, which were waiting for it in the next collective.
    assert took < KILL_DEADLINE, f"the job took {took:.1f} s to end after the kill:\n{out[-5000:]}"
    if not is_open_mpi():  # what MPICH's hydra prints
        plain = re.sub(r"\[\d+\] ?", "", out)
        assert "BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES" in plain, out[-3000:]
        assert "Killed (signal 9)" in plain, out[-3000:]
    return found, out


def _assert_same_weights(got, want, what):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-6, err_msg=what)


@pytest.mark.single_process
def test_killed_jobs_resume_to_the_uninterrupted_weights(tmp_path):
    seed = int(os.environ.get("MPI_STRATEGY_TEST_SEED", random.randrange(10**6)))
    rng = random.Random(seed)
    custom_kill = rng.randint(1, STEPS - 1)
    # Keras: mid-epoch, never on an epoch's last batch (see the module docstring).
    epoch, batch = rng.randrange(EPOCHS), rng.randrange(BATCHES_PER_EPOCH - 1)
    keras_kill = epoch * BATCHES_PER_EPOCH + batch + 1
    what = (
        f"seed {seed}: custom loop killed after step {custom_kill}, Keras after step {keras_kill}"
    )
    print(what)

    _launch(tmp_path, [f"custom:run:{custom_kill}"], expect_kill=True)
    found, out = _launch(
        tmp_path,
        ["custom:run:0", "custom:reference:0", f"keras:run:{keras_kill}"],
        expect_kill=True,
    )
    starts = [r for r in found if r["event"] == "start" and r["variant"] == "custom"]
    resumed_at = (custom_kill // CKPT_EVERY) * CKPT_EVERY
    for rank in (0, 1):  # the resumed run, then the uninterrupted one
        assert [r["start_step"] for r in starts if r["rank"] == rank] == [resumed_at, 0], (
            what,
            out[-5000:],
        )
    _assert_same_weights(
        saved_weights(tmp_path / "custom-run.npz"),
        saved_weights(tmp_path / "custom-reference.npz"),
        what,
    )

    found, out = _launch(tmp_path, ["keras:run:0", "keras:reference:0"], expect_kill=False)
    epochs_run = [r["epochs_run"] for r in found if r["event"] == "fitted" and r["rank"] == 0]
    # Resumed at the start of the epoch in which the kill landed.
    assert epochs_run == [EPOCHS - epoch, EPOCHS], (what, out[-5000:])
    _assert_same_weights(
        saved_weights(tmp_path / "keras-run.npz"),
        saved_weights(tmp_path / "keras-reference.npz"),
        what,
    )
