"""horovod/elastic.py: Horovod's elastic API (``hvd.elastic``,
``mpi_strategy.horovod.tensorflow.elastic`` and ``.keras.elastic``) at any world
size: the states' commit, restore and sync, the reset loop of
``hvd.elastic.run`` (a lost rank simulated: the ULFM calls are replaced by a
duplicate of the communicator), and the Keras callbacks. The test that kills a
rank: tests/launchers/features/elastic/test_elastic.py (Open MPI 5 with ULFM)."""

import numpy as np
import pytest
import tensorflow as tf

import mpi_strategy.horovod.tensorflow as hvd
from mpi_strategy._src.horovod import elastic as elastic_impl
from mpi_strategy.errors import RanksLostError
from mpi_strategy.horovod.tensorflow.keras import elastic as keras_elastic
from mpi_testing import WORLD, assert_same_on_all_ranks

hvd.init()


def _plain(value):
    """``value`` with its numpy arrays as lists (compared with ==)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value.tolist() if isinstance(value, (np.ndarray, np.generic)) else value


def _check(actual, expected):
    """``actual == expected`` on every rank, checked by every rank at once: a
    failure on one rank fails them all (alone, it would leave the others
    waiting in their next collective)."""
    everyone = WORLD.allgather((_plain(actual), _plain(expected)))
    got = [a for a, _ in everyone]
    want = [e for _, e in everyone]
    assert got == want, f"by rank: got {got}, expected {want}"


def _values(variables):
    return [v.numpy().copy() for v in variables]


def _assert_values(variables, expected):
    _check(_values(variables), list(expected))


def test_tensorflow_state_syncs_from_rank_0_restores_and_commits():
    # Horovod's test_elastic_state: rank 0 holds ones, the others twos.
    v = 1.0 if hvd.rank() == 0 else 2.0
    variables = [tf.Variable(np.full((2, 2), v)), tf.Variable(np.full(2, v))]
    state = hvd.elastic.TensorFlowState(variables, batch=20 + hvd.rank(), epoch=10 + hvd.rank())
    state.sync()
    ones = [np.ones((2, 2)), np.ones(2)]
    _assert_values(variables, ones)  # rank 0's, on every rank
    _check((state.batch, state.epoch), (20, 10))
    changed = [np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([0.0, 0.0])]

    def change():
        for variable, value in zip(variables, changed):
            variable.assign(value)
        state.batch, state.epoch = 21, 11

    change()
    state.restore()  # back to the sync, which is a commit
    _assert_values(variables, ones)
    _check((state.batch, state.epoch), (20, 10))
    change()
    state.commit()
    for variable in variables:
        variable.assign(tf.zeros_like(variable))
    state.batch = 99
    state.restore()
    _assert_values(variables, changed)
    _check((state.batch, state.epoch), (21, 11))


def test_object_state_tracks_the_named_attributes_only():
    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, epoch=hvd.rank(), name="a")
    state.epoch, state.other = 5, "not tracked"
    state.restore()
    _check((state.epoch, state.name, state.other), (hvd.rank(), "a", "not tracked"))
    state.epoch = 7
    state.commit()
    state.epoch = 8
    state.restore()
    _check(state.epoch, 7)
    state.epoch = 100 + hvd.rank()
    state.commit()
    state.epoch = -1  # not committed: sync sends the commit
    state.sync()
    _check((state.epoch, state.name), (100, "a"))


def _model(seed):
    model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(2)])
    for i, variable in enumerate(model.variables):
        variable.assign(tf.fill(variable.shape, float(seed + i)))
    return model


def _step(model, optimizer):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tf.ones([2, 3])) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))


def test_tensorflow_keras_state_holds_model_and_optimizer_slots():
    model = _model(seed=10 * hvd.rank())  # different weights on every rank
    optimizer = tf.keras.optimizers.SGD(0.01, momentum=0.9)
    state = hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=hvd.rank())
    assert optimizer.built  # its momentum slots exist: a restore resets them too
    everything = model.variables + optimizer.variables
    state.sync()
    _check(state.epoch, 0)
    _assert_values(
        model.variables, [np.full(v.shape, float(i)) for i, v in enumerate(model.variables)]
    )
    for v in everything:
        assert_same_on_all_ranks(v.numpy(), v.path)
    synced = _values(everything)
    _step(model, optimizer)
    state.epoch = 1
    state.restore()  # weights, momentum and iterations back to the sync
    _assert_values(everything, synced)
    _check(state.epoch, 0)
    _step(model, optimizer)
    state.epoch = 1
    state.commit()
    committed = _values(everything)
    _check(int(optimizer.iterations.numpy()), 1)
    _step(model, optimizer)
    state.epoch = 2
    state.restore()
    _assert_values(everything, committed)
    _check(state.epoch, 1)


def test_keras_state_needs_a_built_model_and_an_optimizer():
    with pytest.raises(ValueError, match="Model must be built first"):
        keras_elastic.KerasState(tf.keras.Sequential([tf.keras.layers.Dense(2)]))
    with pytest.raises(ValueError, match="no optimizer"):
        keras_elastic.KerasState(_model(0))
    model = _model(0)
    model.compile(tf.keras.optimizers.SGD(0.1), "mse")
    state = keras_elastic.KerasState(model, batch=0)
    assert state.optimizer is model.optimizer and state.backend is tf.keras.backend


def _counter_state():
    counter = tf.Variable(0.0)
    state = hvd.elastic.TensorFlowState([counter], step=0)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])
    return counter, state, resets


def test_run_restores_resets_syncs_and_calls_again_after_a_horovod_internal_error():
    counter, state, resets = _counter_state()
    calls = []

    @hvd.elastic.run
    def train(state, answer):
        calls.append((state.step, float(counter.numpy())))
        if len(calls) == 1:
            # Committed, and different on every rank: the sync after the
            # reset gives every rank rank 0's.
            counter.assign(10.0 + hvd.rank())
            state.step = 1 + hvd.rank()
            state.commit()
            # Not committed: the restore undoes it.
            counter.assign(99.0)
            state.step = 99
            raise hvd.elastic.HorovodInternalError("raised on every rank")
        return answer

    _check(train(state, "done"), "done")
    _check(calls, [(0, 0.0), (1, 10.0)])
    _check(resets, [hvd.size()])


@pytest.mark.parametrize("skip_sync", [True, False])
def test_run_after_hosts_updated_does_not_restore_and_syncs_unless_told_to_skip(skip_sync):
    _, state, resets = _counter_state()
    seen = []

    @hvd.elastic.run
    def train(state):
        seen.append(state.step)
        if len(seen) == 1:
            state.step = 5 + hvd.rank()
            state.commit()
            state.step = 50 + hvd.rank()  # not committed
            raise hvd.elastic.HostsUpdatedInterrupt(skip_sync)

    train(state)
    # No restore: skipping the sync keeps this rank's value; the sync sends
    # rank 0's last commit.
    _check(seen, [0, 50 + hvd.rank() if skip_sync else 5])
    _check(resets, [hvd.size()])


def test_run_lets_other_errors_through_without_a_reset():
    _, state, resets = _counter_state()
    calls = []

    @hvd.elastic.run
    def train(state):
        calls.append(1)
        raise ValueError("not a lost rank")

    with pytest.raises(ValueError, match="not a lost rank"):
        train(state)
    assert calls == [1] and resets == []


def _lose_a_rank_in_a_tf_function():
    def raise_lost():
        raise RanksLostError("simulated: a rank died")

    tf.function(lambda: tf.numpy_function(raise_lost, [], tf.float32))()


def _lose_a_rank_as_the_collectives_see_it():
    hvd.global_process_set.ordered.collectives.failed = True  # as RanksLostError leaves it
    raise tf.errors.UnknownError(None, None, "an error that names no class")


def _lose_a_rank_eagerly():
    raise RanksLostError("simulated: a rank died")


@pytest.mark.parametrize(
    "lose",
    [_lose_a_rank_eagerly, _lose_a_rank_in_a_tf_function, _lose_a_rank_as_the_collectives_see_it],
    ids=["eager", "tf_function", "failed_communicator"],
)
def test_run_continues_the_global_process_set_on_the_survivors(monkeypatch, lose):
    # No rank dies here (that needs ULFM): the "survivors" are every rank, on
    # a duplicate of the communicator, which is what the recovery must use.
    shrunk = []

    def shrink(comm):
        shrunk.append(comm.Dup())
        return shrunk[-1]

    monkeypatch.setattr(elastic_impl.ulfm, "shrink", shrink)
    counter, state, resets = _counter_state()
    before = hvd.global_process_set.ordered
    subset = hvd.add_process_set([0]) if hvd.size() > 1 else None

    @tf.function
    def traced_before():  # keeps the collectives of its trace
        return hvd.allreduce(tf.constant(1.0), op=hvd.Sum)

    assert traced_before().numpy() == hvd.size()
    calls = []

    @hvd.elastic.run
    def train(state):
        calls.append((state.step, float(counter.numpy())))
        if len(calls) == 1:
            counter.assign(5.0)  # not committed
            state.step = 3
            lose()
        return hvd.allreduce(tf.constant(1.0), op=hvd.Sum).numpy()

    try:
        _check(train(state), hvd.size())  # the collectives of the new communicator
        _check((len(shrunk), resets), (1, [hvd.size()]))
        _check(calls, [(0, 0.0), (0, 0.0)])
        _check(hvd.global_process_set.ordered is not before, True)
        _check(hvd.global_process_set.mpi_comm is shrunk[0], True)
        # Other process sets are removed: their ranks may be gone.
        _check(subset is None or subset.process_set_id is None, True)

        # The old communicator's collectives raise, saying what to do (at 1
        # rank they make no MPI call: a function traced then stays correct).
        with pytest.raises(elastic_impl.StaleCollectiveError, match="inside the function"):
            before.barrier()
        if hvd.size() > 1:

            @hvd.elastic.run
            def train_with_the_old_function(state):
                return traced_before()

            # Not taken for a lost rank (no second shrink, no reset).
            with pytest.raises(tf.errors.UnknownError, match="traced before it"):
                train_with_the_old_function(state)
            _check((len(shrunk), len(resets)), (1, 1))
    finally:
        hvd.shutdown()  # back on COMM_WORLD for the next tests
        hvd.init()


def test_keras_callbacks_commit_and_count_batches_and_epochs():
    class CommitsRecorded(keras_elastic.KerasState):
        def save(self):
            super().save()
            self.commits.append((self.batch, self.epoch))

    model = _model(0)
    model.compile(tf.keras.optimizers.SGD(0.01), "mse")
    state = CommitsRecorded(model, batch=0, epoch=0)
    state.commits = []
    steps = []

    class StepsOfEachEpoch(tf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            steps.append(self.params["steps"])

    callbacks = [
        keras_elastic.UpdateBatchStateCallback(state),
        keras_elastic.UpdateEpochStateCallback(state),
        keras_elastic.CommitStateCallback(state, batches_per_commit=3),
        StepsOfEachEpoch(),
    ]
    x, y = np.ones((8, 3), np.float32), np.zeros((8, 2), np.float32)
    model.fit(x, y, batch_size=2, epochs=2, callbacks=callbacks, verbose=0)  # 4 batches an epoch
    # After batches 3 and 6 (of 8), and at the end of each epoch.
    assert state.commits == [(2, 0), (0, 1), (1, 1), (0, 2)]
    assert steps == [4, 4]
    fitted = _values(model.variables)
    # A fit resumed in the middle of an epoch: the callbacks are told the
    # batches left; the epochs count on from state.epoch.
    state.batch = 1
    model.fit(x, y, batch_size=2, epochs=2, callbacks=callbacks, verbose=0)
    assert steps[2:] == [3, 4]
    assert state.epoch == 4 and state.commits[-1] == (0, 4)
    assert len(state.commits) == 4 + 4  # the batch count starts again at each fit
    refitted = _values(model.variables)
    model.variables[0].assign(tf.zeros_like(model.variables[0]))
    state.restore()
    _assert_values(model.variables, refitted)
    assert not np.array_equal(fitted[0], refitted[0])
    assert model.train_function is not None
    state.on_reset()  # traced again by the next fit
    assert model.train_function is None
    with pytest.raises(ValueError, match="batches_per_commit must be >= 1"):
        keras_elastic.CommitStateCallback(state, batches_per_commit=0)
