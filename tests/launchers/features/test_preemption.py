"""TensorFlow's PreemptionCheckpointHandler under MPIStrategy, unchanged
(features/preemption.py; tf_keras' BackupAndRestore: features/keras_wrappers.py).

A preemption notice on one rank (a signal it sends itself after a known step:
SIGTERM, TensorFlow's default, on rank 0 (2 ranks) or on the last rank (3);
or SIGUSR1, which the program watches through
``TerminationConfig.termination_watcher_fn`` (2 ranks)) reaches every rank
through the agreement of the next collective: every rank saves one checkpoint
at the same step and the job exits with TensorFlow's restart status (42).
Relaunched, the job resumes there and ends with the weights of an
uninterrupted run, bit for bit. Last (3 ranks), two notices (rank 0 and the
last rank) in a job that cannot finish its step (the last rank stalls) are
followed by SIGKILL of every rank after a grace period, as a scheduler does:
the last periodic checkpoint is complete and the job resumes from it. The
3-rank chain runs under MPIStrategy(shard="gradients"): each rank writes its
share of the optimizer's state in every save.

At 2 ranks the chain also runs Keras fit: tf_keras ``BackupAndRestore(
save_before_preemption=True)`` (SIGTERM on the last rank: every rank saves
after the next step, exit 42, the relaunch resumes at that epoch and step
with the uninterrupted run's weights and optimizer state there) and Keras 3
``BackupAndRestore(save_freq=4)`` (no signal handling: SIGTERM ends the job,
as it ends one process, and the relaunch resumes at the start of the epoch
of the last backup, with that backup's state, as one process does).

The job: the ``handler``, ``tfkeras`` and ``keras3`` variants of
tests/programs/resume_job.py. One chain of launches per world size, each
resuming the previous noticed run and running the next until its notice
(2 ranks: 5 launches, 3 ranks: 3).
"""

import contextlib
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

from mpi_testing import REPO, program, reports, saved_weights
from testing.launch import run_mpiexec

STEPS, CKPT_EVERY = 10, 4
EPOCHS, BATCHES_PER_EPOCH = 3, 5  # Keras fit: 15 steps, a Keras 3 backup every CKPT_EVERY
RESTART_STATUS = 42  # TensorFlow's default exit_fn off Google's platforms
GRACE_PERIOD = 2.0  # seconds between the stalled step and SIGKILL
# By world size, the noticed runs of one chain of launches: (variant, run name,
# notice), the notice's signal, ranks and step (see resume_job.preempted). Each
# launch resumes the previous run, runs its variant's uninterrupted reference
# if it is the variant's first (not for keras3), then the next run until its
# notice. keras3 comes first: a handler built earlier in the process would
# catch its SIGTERM.
CHAINS = {
    2: [
        ("keras3", "term", "SIGTERM/last/9"),
        ("handler", "term-first", "SIGTERM/0/3"),
        ("handler", "usr1", "SIGUSR1/last/2"),
        ("tfkeras", "term", "SIGTERM/last/7"),
    ],
    3: [
        ("handler", "term-last", "SIGTERM/last/5"),
        ("handler", "killed", f"SIGTERM/0+last/{CKPT_EVERY + 2}/stall"),
    ],
}


# The 3-rank chain shards the optimizer's state and gradients (its checkpoints
# are written in parts by the ranks that hold them).
SHARD = {3: "gradients"}


def _launch(ranks, workdir, runs, each_line=None):
    argv = [sys.executable, program("resume_job.py"), str(workdir), str(STEPS), str(CKPT_EVERY)]
    argv += [str(EPOCHS), str(BATCHES_PER_EPOCH), *(":".join(run) for run in runs)]
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
        "RESUME_JOB_SHARD": SHARD.get(ranks, ""),
    }
    started = time.time()
    code, out = run_mpiexec(ranks, argv, silence=180, env=env, each_line=each_line)
    print(f"launch {runs}: exit {code}, {time.time() - started:.1f} s")
    return code, reports(out), out


def _by_rank(found, event, **match):
    return {
        r["rank"]: r
        for r in found
        if r["event"] == event and all(r.get(k) == v for k, v in match.items())
    }


def _killer(pids):
    """An ``each_line`` that SIGKILLs ``pids`` (filled from the start lines)
    GRACE_PERIOD seconds after a rank reports that it stalled."""

    def kill_all():
        time.sleep(GRACE_PERIOD)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def each_line(line):
        for r in reports(line):
            if r["event"] == "start" and r.get("variant") == "handler":
                pids.append(r["pid"])
            if r["event"] == "stalled":
                threading.Thread(target=kill_all, daemon=True).start()

    return each_line


@pytest.mark.slow("a notice on one rank, the save on all, then a relaunch that resumes bit for bit")
@pytest.mark.single_process
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_notice_on_one_rank_saves_the_same_step_everywhere_and_resumes_bit_for_bit(
    tmp_path, ranks
):
    """Also, at 2 ranks, Keras fit: tf_keras ``BackupAndRestore(save_before_preemption=True)``
    saves after the step in which every rank learnt the notice (one step after it),
    exits with 42 and resumes at that epoch and step with the uninterrupted run's
    state there; Keras 3 ``BackupAndRestore(save_freq=CKPT_EVERY)`` has no signal
    handling: SIGTERM ends the job as it ends one process, and the relaunch
    resumes as one process would, at the start of the epoch of the last backup,
    with the state of that backup."""
    previous, resumes_at, referenced, resumed = None, 0, set(), {}
    for variant, name, notice in CHAINS[ranks]:
        pids = []
        stalled = notice.endswith("/stall")
        runs = [(*previous, "0")] if previous else []
        if variant != "keras3" and variant not in referenced:
            runs.append((variant, "reference", "0"))
            referenced.add(variant)
        code, found, out = _launch(
            ranks, tmp_path, [*runs, (variant, name, notice)], _killer(pids) if stalled else None
        )
        if previous:
            _assert_started_at(found, previous, resumes_at, ranks, out)
        resumes_at = _assert_saved(
            tmp_path, (variant, name, notice), code, found, out, pids, resumed
        )
        previous = (variant, name)
    code, found, out = _launch(ranks, tmp_path, [(*previous, "0")])
    assert code == 0, out[-5000:]
    _assert_started_at(found, previous, resumes_at, ranks, out)
    reference = saved_weights(tmp_path / "handler-reference.npz")
    for variant, name, _ in CHAINS[ranks]:
        if variant == "handler":
            for got, want in zip(saved_weights(tmp_path / f"handler-{name}.npz"), reference):
                np.testing.assert_array_equal(got, want, err_msg=name)
        else:  # resumed from the state the run had (tfkeras) or backed up (keras3)
            step, state = resumed[(variant, name)]
            for got, want in zip(
                saved_weights(tmp_path / f"{variant}-{name}-start-{step}.npz"), state
            ):
                np.testing.assert_array_equal(got, want, err_msg=f"{variant}-{name}")


def _assert_saved(tmp_path, run, code, found, out, pids, resumed):
    """What the noticed ``run`` left; returns the step its next launch resumes
    at, and for Keras runs sets ``resumed[(variant, name)]`` to that step and the
    state (weights, optimizer variables) it must resume with."""
    variant, name, notice = run
    ranks = 1 + max(r["rank"] for r in found)
    noticed_at = int(notice.split("/")[2])
    if notice.endswith("/stall"):  # killed: the last periodic checkpoint is the one to resume from
        assert code not in (0, RESTART_STATUS) and len(pids) == 2 * ranks, out[-5000:]
        return noticed_at // CKPT_EVERY * CKPT_EVERY
    if variant == "keras3":  # ended by SIGTERM, as one process; resumes at the backup's epoch
        assert code not in (0, RESTART_STATUS), out[-5000:]
        backed_up = noticed_at // CKPT_EVERY * CKPT_EVERY
        resumed[(variant, name)] = (
            (backed_up - 1) // BATCHES_PER_EPOCH * BATCHES_PER_EPOCH,
            saved_weights(tmp_path / f"keras3-{name}-at-{backed_up}.npz"),
        )
        return resumed[(variant, name)][0]
    # Saved before the next step (handler) or after it (tfkeras: fit checks
    # after each step), on every rank: the notice rode a collective of the step.
    saved_at = noticed_at + (variant == "tfkeras")
    assert code == RESTART_STATUS, out[-5000:]
    saved = {r: e["steps"] for r, e in _by_rank(found, "exit", run=f"{variant}-{name}").items()}
    assert saved == dict.fromkeys(range(ranks), saved_at), out[-5000:]
    if variant == "tfkeras":  # resumes with the uninterrupted run's state there
        state = saved_weights(tmp_path / f"tfkeras-reference-at-{saved_at}.npz")
        resumed[(variant, name)] = (saved_at, state)
    return saved_at


def _assert_started_at(found, run, step, ranks, out):
    variant, name = run
    starts = {
        r: s["start_step"] for r, s in _by_rank(found, "start", run=f"{variant}-{name}").items()
    }
    assert starts == dict.fromkeys(range(ranks), step), (run, out[-5000:])


def _launchers_started_here():
    """The pids of this process's children whose command line names mpiexec."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if parent == os.getpid() and b"mpiexec" in command:
            found.append(int(entry))
    return found


@pytest.mark.single_process
def test_the_slurm_example_saves_on_sigterm_to_mpiexec_and_resumes(tmp_path):
    """examples/slurm/train.py as examples/slurm/train.sbatch runs it: SIGTERM to
    mpiexec (the batch script's trap) reaches every rank; the job saves, exits
    with 42, and the next launch resumes from the saved step."""
    import tensorflow as tf

    example = os.path.join(REPO, "examples", "slurm", "train.py")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    sent = []

    def notice_once_training(line):
        if "step 50:" in line and not sent:
            sent.extend(_launchers_started_here())
            for pid in sent:
                os.kill(pid, signal.SIGTERM)

    argv = [sys.executable, example, "--checkpoint-dir", str(tmp_path), "--steps", "100000"]
    code, out = run_mpiexec(2, argv, silence=180, env=env, each_line=notice_once_training)
    assert code == RESTART_STATUS and len(sent) == 1, out[-5000:]
    latest = tf.train.latest_checkpoint(str(tmp_path))
    (counter,) = (n for n, _ in tf.train.list_variables(latest) if n.startswith("optimizer/_iter"))
    saved = int(tf.train.load_variable(latest, counter))  # the optimizer's step count
    assert saved >= 50, out[-5000:]
    argv[-1] = str(saved + 10)
    code, out = run_mpiexec(2, argv, silence=180, env=env)
    assert code == 0, out[-5000:]
    assert f"starting at step {saved} of {saved + 10}" in out and "final loss" in out, out[-5000:]
