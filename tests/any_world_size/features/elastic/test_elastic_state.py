"""features/elastic/state.py and run.py (public as mpi_strategy.elastic): elastic
training's State, at any world size: commits and restores, and what elastic.run
lets through. The tests that kill ranks:
tests/launchers/features/elastic/test_elastic.py."""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import mpi_strategy
from mpi_strategy._src.features.elastic import recovery, sharded, state as state_lib
from mpi_strategy._src.features.elastic.sharded import lost_shares
from mpi_strategy._src.features.sharding import _whole
from mpi_strategy.errors import RanksLostError
from mpi_testing import RANK, SIZE, local_devices, mpi_strategy_under_test


def _model_and_optimizer(strategy):
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(2)])
        optimizer = tf.keras.optimizers.SGD(0.1, momentum=0.9)
    return model, optimizer


def _step(strategy, model, optimizer, features=3):
    def replica_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(tf.ones([2, features])) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    strategy.run(tf.function(replica_step))


def test_state_commits_and_restores_variables_slots_and_values():
    strategy = mpi_strategy_under_test()
    model, optimizer = _model_and_optimizer(strategy)
    state = mpi_strategy.elastic.State(model, optimizer, step=0)
    # run() builds the optimizer's slots before the first commit, so a rollback
    # to it resets them (here by hand: no failure to recover from).
    mpi_strategy._src.features.elastic.run._build_optimizers(strategy, (model, optimizer))
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


def _nadam_weights_after_five_steps(shard, traced, restore):
    """tf_keras Nadam's weights after 5 steps; ``restore``: 2 steps more after
    the commit at step 2, then set back to it."""
    strategy = mpi_strategy.MPIStrategy(shard=shard, devices=local_devices())
    with strategy.scope():
        model = tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(2)])
        model.set_weights([np.full((3, 2), 0.5, np.float32), np.zeros(2, np.float32)])
        optimizer = tf_keras.optimizers.Nadam(0.1)
    state = mpi_strategy.elastic.State(model, optimizer)
    mpi_strategy._src.features.elastic.run._build_optimizers(strategy, (model, optimizer))

    def replica_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(tf.ones([2, 3])) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    step = tf.function(replica_step) if traced else replica_step  # (traced once)
    for steps in (2, "commit", 2, "restore", 3) if restore else (2, "commit", 3):
        if steps in ("commit", "restore"):
            getattr(state, steps)()
            continue
        for _ in range(steps):
            strategy.run(step)
    return [v.numpy() for v in model.variables]


@pytest.mark.parametrize(
    "shard, traced", [(None, True), (None, False), ("optimizer", True)], ids=str
)
def test_a_restore_sets_tf_keras_nadams_product_back(shard, traced):
    # Nadam's product of its momentum schedule (and the Python count of its
    # updates, which its eager update reads) is not among its variables.
    interrupted = _nadam_weights_after_five_steps(shard, traced, restore=True)
    for got, want in zip(
        interrupted, _nadam_weights_after_five_steps(shard, traced, restore=False), strict=True
    ):
        np.testing.assert_array_equal(got, want)


def test_run_makes_tf_keras_slots_before_the_first_commit():
    # (As Keras 3's: a rollback to the first commit resets them; a sharded
    # optimizer's are cut for the survivors, not left on the lost ranks.)
    strategy = mpi_strategy_under_test()
    with strategy.scope():
        model = tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(2)])
        optimizer = tf_keras.optimizers.SGD(0.1, momentum=0.9)
    state = mpi_strategy.elastic.State(model, optimizer)

    @mpi_strategy.elastic.run(strategy, state)
    def train(state):
        return len(state_lib.commit_of(state, 1)[1][0])

    # the weights, the step count, a momentum per weight
    assert train() == 2 + 1 + 2


@pytest.mark.skipif(SIZE == 1, reason="one rank holds everything")
def test_a_restore_over_same_shape_variables_swapped_on_a_rank_raises_on_every_rank():
    # Two kernels of one shape swapped in one rank's commit would be cut alike,
    # each slot then set from the other's values: the ranks compare the
    # positions they make the slots again over (sharded.restore) first.
    strategy = mpi_strategy.MPIStrategy(shard="optimizer", devices=local_devices())
    with strategy.scope():
        layers = [tf_keras.layers.Dense(3), tf_keras.layers.Dense(3)]
        model = tf_keras.Sequential([tf_keras.Input((3,)), *layers])
        optimizer = tf_keras.optimizers.Adam(0.1)
        optimizer.build(model.trainable_variables)
    state = mpi_strategy.elastic.State(model, optimizer)
    state.commit()
    trackables = state_lib.trackables_of(state)
    _, committed, _, copies = state_lib.commit_of(state, None)
    assert copies.built_with == ((0, (0, 1, 2, 3)),)  # kernel, bias, kernel, bias

    def restore(positions):
        built_with = ((0, positions),)
        sharded.restore(
            strategy,
            trackables,
            lambda: state_lib.variables_of(trackables),
            committed,
            dataclasses.replace(copies, built_with=built_with),
        )

    with pytest.raises(
        mpi_strategy.MPIStrategyError,
        match=rf"rank {SIZE - 1}'s 4 variables differ from rank 0's 4 first at #0: "
        r"\(3, 3\) float32 \(position 2\) there, \(3, 3\) float32 \(position 0\) on rank 0",
    ):
        restore((2, 1, 0, 3) if RANK == SIZE - 1 else (0, 1, 2, 3))
    restore((0, 1, 2, 3))  # (left as it was: made again)


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


def test_run_recovers_from_a_rank_lost_on_another_communicator_inside_a_tf_function(
    monkeypatch,
):
    """A RanksLostError of a communicator other than the strategy's (a second
    OrderedComm, a Horovod set) raised inside a tf.function reaches elastic.run
    as a tf.errors class, with the strategy's communicator not failed: it is
    still a lost rank (the rule Horovod's face follows too)."""
    # No rank dies here (that needs ULFM): the "survivors" are every rank, on a
    # duplicate of the communicator, which is what the recovery must use.
    monkeypatch.setattr(recovery.ulfm, "shrink", lambda comm: comm.Dup())
    strategy = mpi_strategy_under_test()
    model, optimizer = _model_and_optimizer(strategy)
    state = mpi_strategy.elastic.State(model, optimizer, step=0)
    recoveries = len(recovery.record().recoveries)
    calls = []

    def lose_a_rank():
        raise RanksLostError("simulated: a rank of another communicator died")

    @mpi_strategy.elastic.run(strategy, state)
    def train(state):
        calls.append(state.step)
        if len(calls) == 1:
            state.step = 3  # not committed: rolled back
            tf.function(lambda: tf.numpy_function(lose_a_rank, [], tf.float32))()
        return "done"

    assert train() == "done" and calls == [0, 0]
    assert len(recovery.record().recoveries) == recoveries + 1
    assert strategy.extended.ordered_comm.size == SIZE
    _step(strategy, model, optimizer)  # on the survivors' communicator


@pytest.mark.parametrize("k", [keras, tf_keras], ids=["keras", "tf_keras"])
def test_run_recovers_a_sharded_optimizers_slots_from_the_commit(monkeypatch, k):
    """MPIStrategy(shard="optimizer"): the recovery makes the optimizer's slots
    again for the survivors and sets each from the commit, put together from
    the ranks that hold its pieces (a loss scale optimizer's: its inner
    one's). No rank dies here (that needs ULFM:
    tests/launchers/features/elastic/test_elastic.py loses one): every rank
    survives, on a duplicate of the communicator."""
    monkeypatch.setattr(recovery.ulfm, "shrink", lambda comm: comm.Dup())
    strategy = mpi_strategy.MPIStrategy(shard="optimizer", devices=local_devices())
    with strategy.scope():
        model = k.Sequential([k.Input((20,)), k.layers.Dense(32)])
        optimizer = k.mixed_precision.LossScaleOptimizer(k.optimizers.Adam(0.1))
    state = mpi_strategy.elastic.State(model, optimizer)
    committed = []

    def whole_state():
        return [v.numpy() for v in model.variables] + [_whole(v) for v in optimizer.variables]

    @mpi_strategy.elastic.run(strategy, state)
    def train(state):
        if not committed:
            _step(strategy, model, optimizer, features=20)
            state.commit()
            committed.extend(whole_state())
            _step(strategy, model, optimizer, features=20)  # not committed: rolled back
            raise RanksLostError("simulated: a rank died")
        return "done"

    assert train() == "done" and strategy.extended.ordered_comm.size == SIZE
    for got, want in zip(whole_state(), committed, strict=True):
        np.testing.assert_array_equal(got, want)
    _step(strategy, model, optimizer, features=20)  # the new slots, on the new communicator


def test_a_lost_share_is_one_lost_with_its_copy_on_the_next_rank():
    # Rank r's slots are on r and r + 1 (mod the size).
    assert lost_shares(4, [0, 2]) == []  # 1 and 3 lost: their copies on 2 and 0
    assert lost_shares(4, [0, 1]) == [2]  # 2 and 3 lost: 3's copy is on 0
    assert lost_shares(3, [1]) == [2]  # 0 and 2 lost: 0's copy is on 1
    assert lost_shares(2, [0]) == []


def test_a_sharded_optimizer_commits_only_with_the_variables_it_was_built_with():
    # A commit names them by their place among the state's (a replacement
    # builds its optimizer over them: test_elastic.py); at 1 rank nothing is sharded.
    strategy = mpi_strategy.MPIStrategy(shard="optimizer", devices=local_devices())
    with strategy.scope():
        model = tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(2)])
        optimizer = tf_keras.optimizers.SGD(0.1, momentum=0.9)
        optimizer.build(model.trainable_variables)
    state = mpi_strategy.elastic.State(optimizer)
    if SIZE == 1:
        state.commit()
        return
    with pytest.raises(mpi_strategy.MPIStrategyError, match=r"not in the State \(.*kernel"):
        state.commit()
    mpi_strategy.elastic.State(model, optimizer).commit()
