"""features/preemption.py: TensorFlow's PreemptionCheckpointHandler in one process
per rank, with an ``exit_fn`` that returns (so the test sees what the ranks
decided): a SIGTERM on the last rank makes every rank save at the same step and
call exit_fn there; with a ``grace_period`` every rank saves at once, trains on,
and saves and exits again at the same later step, once the grace period is over.

The launched jobs (restart status, resuming bit for bit, other signals):
tests/launchers/features/test_preemption.py."""

import signal
import time

import numpy as np
import pytest
import tensorflow as tf

from mpi_strategy._src.core.process import PROCESS
from mpi_testing import RANK, SIZE, WORLD, assert_same_on_all_ranks, mpi_strategy_under_test

NOTICE_STEP = 3
STEP_SECONDS = 0.05


class Exited(Exception):
    """What the test's exit_fn raises instead of ending the process."""


@pytest.fixture
def fresh_notice():
    """No notice posted before; afterwards, none posted and TensorFlow's
    SIGTERM handler gone."""
    previous = signal.getsignal(signal.SIGTERM)
    PROCESS.notice = 0
    yield
    signal.signal(signal.SIGTERM, previous)
    PROCESS.notice = 0
    for agreement in list(PROCESS.agreements):
        agreement.notice = 0


def _train_until_exit(directory, grace_period):
    """Trains until exit_fn; returns (the steps saved at, the step exited at,
    seconds from the notice to the exit)."""
    strategy = mpi_strategy_under_test()
    with strategy.scope():
        step = tf.Variable(0, dtype=tf.int64)
        total = tf.Variable(0.0)
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(total=total, step=step), directory, 3)
    saved = []

    def save():
        saved.append(int(step.numpy()))
        manager.save()

    def exit_fn():
        raise Exited

    config = tf.distribute.experimental.TerminationConfig(
        exit_fn=exit_fn, grace_period=grace_period, save_fn=save
    )
    handler = tf.distribute.experimental.PreemptionCheckpointHandler(
        strategy.cluster_resolver, manager, termination_config=config
    )

    @tf.function
    def train_step():
        total.assign_add(strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), None))
        step.assign_add(1)

    noticed = None
    try:
        while step.numpy() < 100:
            handler.run(train_step)
            time.sleep(STEP_SECONDS)
            if step.numpy() == NOTICE_STEP:
                noticed = time.monotonic()
                if RANK == SIZE - 1:
                    signal.raise_signal(signal.SIGTERM)
    except Exited:
        return saved, int(step.numpy()), time.monotonic() - noticed
    raise AssertionError("the handler never called exit_fn")


def _shared_directory(tmp_path):
    return WORLD.bcast(str(tmp_path) if RANK == 0 else None)


def test_a_notice_on_the_last_rank_saves_and_exits_at_the_same_step_everywhere(
    tmp_path, fresh_notice
):
    saved, exited, _ = _train_until_exit(_shared_directory(tmp_path), grace_period=0)
    # Learnt in the collectives of the step after the notice (at once on 1 rank).
    expected = NOTICE_STEP + (SIZE > 1)
    assert (saved, exited) == ([expected], expected)
    assert_same_on_all_ranks(np.array([*saved, exited]), "steps saved and exited at")


def test_with_a_grace_period_every_rank_saves_trains_on_and_exits_at_the_same_step(
    tmp_path, fresh_notice
):
    grace = 1.0
    saved, exited, took = _train_until_exit(_shared_directory(tmp_path), grace_period=grace)
    assert len(saved) == 2 and saved[0] == NOTICE_STEP + (SIZE > 1), saved
    assert saved[1] == exited > saved[0] + 2, (saved, exited)
    assert took >= grace / 2, took  # (less TensorFlow's margin of six steps)
    assert_same_on_all_ranks(np.array([*saved, exited]), "steps saved and exited at")
