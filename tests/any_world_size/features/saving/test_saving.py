"""features/saving/ (calls.py, write_point.py): saving as a one-process program
does, every rank making the same call.

Each TensorFlow and Keras API that writes, called on every rank with the same
path, leaves one complete copy (written by rank 0; the other ranks write
nothing to disk), returns on every rank only once that copy is complete (a
load right after succeeds everywhere), and holds what the model holds. A save
made on rank 0 alone still works, and one that cannot (it reads a metric, a
collective) fails with the cause on every rank instead of hanging. A save of
an object that no strategy built makes no MPI call (rank 0 may make it while
the others wait in a barrier), is written once, and leaves in the directory
only what one process writes.

Saving at the end of a program and a kill during a write:
tests/launchers/features/saving/test_saving_launched.py.
"""

import errno
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import mpi_strategy
from mpi_testing import NUM_REPLICAS, RANK, SIZE, WORLD, assert_same_on_all_ranks

FEATURES, UNITS = 256, 1024  # >= 1 MB per artifact: a non-writer's copy would stand out
FIRST_CALL_BYTES = 64 << 10  # what a first call may write anywhere (autograph's sources)
BATCH = 2 * NUM_REPLICAS  # equal pieces per replica (Keras builds from the first batch)


def written_bytes():
    """Bytes this process has sent to storage so far (Linux /proc; not tmpfs)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))


def build(K, strategy):
    """A compiled, trained model whose metrics hold state (sync-on-read variables)."""
    with strategy.scope():
        model = K.Sequential(
            [K.Input((FEATURES,)), K.layers.Dense(UNITS, activation="relu"), K.layers.Dense(2)]
        )
        model.compile(optimizer=K.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    x = np.linspace(0, 1, 2 * BATCH * FEATURES, dtype=np.float32).reshape(2 * BATCH, FEATURES)
    model.fit(x, np.ones((2 * BATCH, 2), np.float32), batch_size=BATCH, epochs=1, verbose=0)
    return model


@pytest.fixture(scope="module")
def models(strategy):
    return {"keras": build(keras, strategy), "tf_keras": build(tf_keras, strategy)}


def _checkpoint_of(model):
    return tf.train.Checkpoint(model=model, optimizer=model.optimizer)


def _restored_checkpoint(model, path):
    fresh = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    fresh.restore(path).assert_existing_objects_matched()
    return model.get_weights()


# name: (Keras, save(model, path) -> path to load, load(model, path) -> weights)
SAVES = {
    "Checkpoint.save": (
        "keras",
        lambda m, p: _checkpoint_of(m).save(os.path.join(p, "ckpt")),
        _restored_checkpoint,
    ),
    "Checkpoint.write": (
        "keras",
        lambda m, p: _checkpoint_of(m).write(os.path.join(p, "ckpt")),
        lambda m, p: (_checkpoint_of(m).read(p), m.get_weights())[1],
    ),
    "CheckpointManager.save": (
        "keras",
        lambda m, p: [tf.train.CheckpointManager(_checkpoint_of(m), p, 1).save() for _ in range(2)][
            -1
        ],
        lambda m, p: _restored_checkpoint(m, tf.train.latest_checkpoint(os.path.dirname(p))),
    ),
    "tf.saved_model.save": (
        "keras",
        lambda m, p: (tf.saved_model.save(m, p), p)[1],
        lambda m, p: _saved_model_arrays(p),
    ),
    "keras.Model.save": (
        "keras",
        lambda m, p: (m.save(p + ".keras"), p + ".keras")[1],
        lambda m, p: keras.models.load_model(p).get_weights(),
    ),
    "keras.Model.save_weights": (
        "keras",
        lambda m, p: (m.save_weights(p + ".weights.h5"), p + ".weights.h5")[1],
        lambda m, p: (m.load_weights(p), m.get_weights())[1],
    ),
    "keras.Model.export": (
        "keras",
        lambda m, p: (m.export(p, verbose=False), p)[1],
        lambda m, p: _saved_model_arrays(p),
    ),
    "tf_keras.Model.save(SavedModel)": (
        "tf_keras",
        lambda m, p: (m.save(p), p)[1],
        lambda m, p: tf_keras.models.load_model(p).get_weights(),
    ),
    "tf_keras.Model.save(.h5)": (
        "tf_keras",
        lambda m, p: (m.save(p + ".h5"), p + ".h5")[1],
        lambda m, p: tf_keras.models.load_model(p).get_weights(),
    ),
    "tf_keras.Model.save(.keras)": (
        "tf_keras",
        lambda m, p: (m.save(p + ".keras"), p + ".keras")[1],
        lambda m, p: tf_keras.models.load_model(p).get_weights(),
    ),
    "tf_keras.Model.save_weights(tf)": (
        "tf_keras",
        lambda m, p: (m.save_weights(p), p)[1],
        lambda m, p: (m.load_weights(p), m.get_weights())[1],
    ),
    "tf_keras.Model.save_weights(.h5)": (
        "tf_keras",
        lambda m, p: (m.save_weights(p + ".h5"), p + ".h5")[1],
        lambda m, p: (m.load_weights(p), m.get_weights())[1],
    ),
}


def _saved_model_arrays(path):
    """The arrays of a SavedModel (it loads: served by ``tf.saved_model.load``)."""
    assert tf.saved_model.load(path) is not None
    reader = tf.train.load_checkpoint(os.path.join(path, "variables", "variables"))
    return [
        reader.get_tensor(name)
        for name in reader.get_variable_to_shape_map()
        if not name.startswith("_CHECKPOINTABLE_OBJECT_GRAPH")
    ]


def _files_under(directory):
    return sorted(
        os.path.relpath(os.path.join(d, f), directory)
        for d, _, files in os.walk(directory)
        for f in files
    )


@pytest.mark.parametrize("api", list(SAVES))
def test_a_save_on_every_rank_lands_once_and_loads_everywhere(models, strategy, shared_dir, api):
    K, save, load = SAVES[api]
    model = models[K]
    expected = [w.copy() for w in model.get_weights()]
    directory = os.path.join(shared_dir, "out")
    os.makedirs(directory, exist_ok=True)
    before = written_bytes()
    path = save(model, os.path.join(directory, "saved"))
    wrote = written_bytes() - before
    assert_same_on_all_ranks(
        np.frombuffer(os.fspath(path).encode().ljust(512), np.uint8), "returned path"
    )
    # Complete and visible on every rank as soon as the call returned.
    loaded = load(model, path)
    if api.startswith(("tf.saved_model", "keras.Model.export")):  # named, not ordered
        for weight in model.get_weights():
            assert any(a.shape == weight.shape and np.array_equal(a, weight) for a in loaded)
    else:
        assert len(loaded) == len(expected)
        for got, ref in zip(loaded, expected):
            np.testing.assert_array_equal(got, ref)
    files = _files_under(directory)
    assert files and not any("_temp" in f or "tmp" in f for f in files), files
    artifact_bytes = sum(os.path.getsize(os.path.join(directory, f)) for f in files)
    WORLD.Barrier()  # every rank has looked before the next test reuses the directory
    assert artifact_bytes > 1_000_000
    if RANK != 0:  # rank 0 writes; the others write nothing to disk
        assert wrote <= FIRST_CALL_BYTES, (wrote, artifact_bytes)
    else:
        assert wrote >= artifact_bytes * 9 // 10, (wrote, artifact_bytes)
    if RANK == 0:
        import shutil

        shutil.rmtree(directory)
    WORLD.Barrier()


def test_loads_inside_the_scope_on_every_rank(models, strategy, shared_dir):
    model = models["keras"]
    model.save(os.path.join(shared_dir, "m.keras"))
    _checkpoint_of(model).write(os.path.join(shared_dir, "ckpt", "ckpt"))
    tf.saved_model.save(model, os.path.join(shared_dir, "sm"))
    models["tf_keras"].save(os.path.join(shared_dir, "tfk"))
    with strategy.scope():  # variables created here start from rank 0's values
        loaded = keras.models.load_model(os.path.join(shared_dir, "m.keras"))
        fresh = build(keras, strategy)
        _checkpoint_of(fresh).read(os.path.join(shared_dir, "ckpt", "ckpt"))
        served = tf.saved_model.load(os.path.join(shared_dir, "sm"))
        tfk = tf_keras.models.load_model(os.path.join(shared_dir, "tfk"))
    for got, want in zip(
        loaded.get_weights() + fresh.get_weights(), model.get_weights() + model.get_weights()
    ):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(tfk.get_weights(), models["tf_keras"].get_weights()):
        np.testing.assert_array_equal(got, want)
    assert served is not None


def test_saving_an_untrained_tf_keras_model_keeps_its_metrics_global(strategy, shared_dir):
    """tf_keras creates the metrics' variables while saving a model not yet
    trained: they must be the strategy's (summed over ranks), not each rank's."""
    with strategy.scope():
        model = tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(2)])
        model.compile(
            optimizer="sgd",
            metrics=["accuracy"],
            loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    model.save(os.path.join(shared_dir, "untrained"))
    x = np.linspace(-1, 1, 6 * BATCH, dtype=np.float32).reshape(2 * BATCH, 3)
    y = (np.arange(2 * BATCH) * 7 % 3 == 0).astype(np.int64)  # ranks see different labels
    accuracy = model.fit(x, y, batch_size=BATCH, verbose=0).history["accuracy"][-1]
    assert_same_on_all_ranks(np.float32(accuracy), "accuracy")


def test_an_asynchronous_checkpoint_is_written_synchronously(models, shared_dir):
    if SIZE == 1:
        pytest.skip("one process: TensorFlow's own asynchronous write")
    options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)
    prefix = os.path.join(shared_dir, "async", "ckpt")
    path = _checkpoint_of(models["keras"]).save(prefix, options=options)
    assert path == prefix + "-1" and os.path.exists(path + ".index")  # complete on return
    manager = tf.train.CheckpointManager(
        _checkpoint_of(models["keras"]), os.path.join(shared_dir, "async-manager"), 1
    )
    path = manager.save(options=options)
    assert os.path.exists(path + ".index")


def test_summary_writers_write_one_event_file(strategy, shared_dir):
    logdir = os.path.join(shared_dir, "logs")
    writer = tf.summary.create_file_writer(logdir)
    with writer.as_default():
        for step in range(3):
            tf.summary.scalar(
                "loss", strategy.reduce("SUM", tf.constant(1.0), axis=None), step=step
            )
    writer.close()
    events = os.listdir(logdir)
    assert len(events) == 1, events
    assert os.listdir(shared_dir) == ["logs"]  # (no record or lock file beside it)
    assert_same_on_all_ranks(np.array(len(events)), "event files seen")


def test_keras_callbacks_write_once_and_are_complete_when_fit_returns(strategy, shared_dir):
    """The race this guards (rank 1 leaving fit while rank 0 still writes) shows
    in most runs without write points: repeated to make it fail reliably."""
    model = build(keras, strategy)
    x = np.ones((2 * BATCH, FEATURES), np.float32)
    y = np.zeros((2 * BATCH, 2), np.float32)
    for attempt in range(5):
        directory = os.path.join(shared_dir, f"fit{attempt}")
        model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=2,
            verbose=0,
            callbacks=[
                keras.callbacks.ModelCheckpoint(
                    os.path.join(directory, "best.weights.h5"), save_weights_only=True
                ),
                keras.callbacks.BackupAndRestore(os.path.join(directory, "backup")),
                keras.callbacks.CSVLogger(os.path.join(directory, "log.csv")),
                keras.callbacks.TensorBoard(os.path.join(directory, "tb")),
            ],
        )
        model.load_weights(os.path.join(directory, "best.weights.h5"))  # right after fit
        with open(os.path.join(directory, "log.csv")) as f:
            assert len(f.read().splitlines()) == 3  # header + 2 epochs, on every rank
        assert sorted(os.listdir(directory)) == ["best.weights.h5", "log.csv", "tb"]
        assert len(os.listdir(os.path.join(directory, "tb", "train"))) == 1


def _epoch_losses(logdir):
    """How many "epoch_loss" events the event files under ``logdir`` hold now."""
    files = [os.path.join(d, f) for d, _, names in os.walk(logdir) for f in names]
    return sum(
        value.tag == "epoch_loss"
        for path in files
        for event in tf.compat.v1.train.summary_iterator(path)
        for value in event.summary.value
    )


def _csv_rows(directory):
    """How many rows (past the header) log.csv in ``directory`` holds now."""
    path = os.path.join(directory, "log.csv")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return max(len(f.read().splitlines()) - 1, 0)


@pytest.mark.parametrize("K", [keras, tf_keras], ids=["keras", "tf_keras"])
def test_keras_callbacks_files_are_complete_at_each_epoch_end(K, strategy, shared_dir):
    """CSVLogger's row and TensorBoard's epoch summaries, read by a callback
    after them at the end of each epoch, on every rank: the rank that does not
    write used to read them before the writing rank had flushed them (Keras 3's
    CSV short in about half the epochs, tf_keras's not yet created)."""
    with strategy.scope():
        model = K.Sequential([K.Input((4,)), K.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((2 * BATCH, 4), np.float32), np.zeros((2 * BATCH, 2), np.float32)
    short = []

    class Reader(K.callbacks.Callback):
        """Counts, at each epoch's end, the epochs that ``count`` finds short."""

        def __init__(self, what, count):
            super().__init__()
            self.what, self.count = what, count

        def on_epoch_end(self, epoch, logs=None):
            if self.count(directory) != epoch + 1:
                short.append((self.what, attempt, epoch))

    for attempt in range(4):
        directory = os.path.join(shared_dir, f"epochs{attempt}")
        callbacks = [  # (each reader right after the callback whose file it reads)
            K.callbacks.CSVLogger(os.path.join(directory, "log.csv")),
            Reader("csv", _csv_rows),
            K.callbacks.TensorBoard(os.path.join(directory, "tb")),
            Reader("tb", lambda d: _epoch_losses(os.path.join(d, "tb"))),
        ]
        model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, callbacks=callbacks)
    everyone = WORLD.allgather(short)
    assert not any(everyone), f"epochs whose files were short, per rank: {everyone}"


def test_checkpoint_saves_on_every_rank_never_race(strategy, shared_dir):
    """Without write points the ranks share TensorFlow's ``<prefix>_temp``
    staging directory and one rank's merge deletes it under the other (about
    one save in ten): repeated enough to fail without them."""
    with strategy.scope():
        variable = tf.Variable(tf.zeros([200_000]))
    checkpoint = tf.train.Checkpoint(v=variable)
    prefix = os.path.join(shared_dir, "race", "ckpt")
    for step in range(40):
        variable.assign(tf.fill([200_000], float(step)))
        path = checkpoint.save(prefix)
        variable.assign(tf.zeros([200_000]))
        checkpoint.restore(path).assert_consumed()
        assert float(variable[-1]) == step


def test_rank0_saving_alone_still_works(models, strategy, shared_dir):
    model = models["keras"]
    path = os.path.join(shared_dir, "alone.keras")
    if RANK == 0:  # the hand-written guard of programs written for other strategies
        model.save(path)
        _checkpoint_of(model).write(os.path.join(shared_dir, "alone", "ckpt"))
    # The others go on to their next collective and meet rank 0 there.
    assert float(strategy.reduce("SUM", tf.constant(1.0), axis=None)) == SIZE
    assert os.path.exists(path)
    np.testing.assert_array_equal(
        keras.models.load_model(path).get_weights()[0], model.get_weights()[0]
    )


def test_ranks_saving_the_same_path_without_the_others_do_not_race(models, strategy, shared_dir):
    if SIZE < 3:
        pytest.skip("needs two ranks that save and one that does not")
    path = os.path.join(shared_dir, "some.weights.h5")
    before = written_bytes()
    if RANK != 0:  # all but rank 0 make the call: the lowest of them writes
        models["keras"].save_weights(path)
    wrote = written_bytes() - before
    strategy.reduce("SUM", tf.constant(1.0), axis=None)  # rank 0 meets them here
    assert os.path.getsize(path) > 1_000_000
    if RANK > 1:
        assert wrote <= FIRST_CALL_BYTES, wrote


def test_rank0_saving_a_metric_alone_fails_on_every_rank(strategy, shared_dir):
    if SIZE == 1:
        pytest.skip("needs other ranks")
    with strategy.scope():
        total = tf.Variable(
            0.0,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.SUM,
        )
    strategy.run(lambda: total.assign_add(1.0))
    with pytest.raises(Exception) as raised:
        if RANK == 0:
            tf.train.Checkpoint(total=total).write(os.path.join(shared_dir, "metric", "ckpt"))
        else:
            strategy.reduce("SUM", tf.constant(1.0), axis=None)
    assert "saving alone" in str(raised.value), raised.value
    assert "every rank" in str(raised.value)
    # The ranks agree on what went wrong and can go on.
    assert float(strategy.reduce("SUM", tf.constant(1.0), axis=None)) == SIZE


def test_a_failed_write_raises_on_every_rank(models, shared_dir):
    blocker = os.path.join(shared_dir, "not-a-directory")
    if RANK == 0:
        with open(blocker, "w") as f:
            f.write("x")
    WORLD.Barrier()
    with pytest.raises(Exception) as raised:
        models["keras"].save_weights(os.path.join(blocker, "w.weights.h5"))
    if RANK != 0:  # rank 0 raises its own error; the others name it
        assert isinstance(raised.value, mpi_strategy.MPIStrategyError)
        assert "failed on another rank" in str(raised.value) and "rank 0" in str(raised.value)
    # ... and can go on.
    assert (
        float(models["keras"].distribute_strategy.reduce("SUM", tf.constant(1.0), axis=None))
        == SIZE
    )


def test_only_chief_writes_is_deprecated_and_yields_the_path(shared_dir):
    target = os.path.join(shared_dir, "file.txt")
    with pytest.warns(DeprecationWarning), mpi_strategy.only_chief_writes(target) as where:
        assert where == target


def _unscoped_model():
    """A Keras model that no strategy built (outside any scope)."""
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(UNITS)])
    model.set_weights([np.full(w.shape, 0.5, w.dtype) for w in model.get_weights()])
    return model


# name: save(object, directory) -> what load(directory) must give back
UNSCOPED_SAVES = {
    "Checkpoint.save": lambda m, d: tf.train.Checkpoint(model=m).save(os.path.join(d, "ckpt")),
    "CheckpointManager.save": lambda m, d: tf.train.CheckpointManager(
        tf.train.Checkpoint(model=m), os.path.join(d, "manager"), 1
    ).save(),
    "tf.saved_model.save": lambda m, d: tf.saved_model.save(m, os.path.join(d, "sm")),
    "keras.Model.save": lambda m, d: m.save(os.path.join(d, "m.keras")),
    "keras.Model.save_weights": lambda m, d: m.save_weights(os.path.join(d, "w.weights.h5")),
}
# What one process leaves after UNSCOPED_SAVES (TensorFlow's own staging is gone).
UNSCOPED_FILES = [
    "checkpoint",
    "ckpt-1.data-00000-of-00001",
    "ckpt-1.index",
    "m.keras",
    "manager/checkpoint",
    "manager/ckpt-1.data-00000-of-00001",
    "manager/ckpt-1.index",
    "sm/fingerprint.pb",
    "sm/saved_model.pb",
    "sm/variables/variables.data-00000-of-00001",
    "sm/variables/variables.index",
    "w.weights.h5",
]


def _loads_unscoped(directory):
    """Loads what UNSCOPED_SAVES wrote under ``directory``: every copy complete,
    and nothing else there (a listing shows no file of this library's)."""
    assert _files_under(directory) == UNSCOPED_FILES
    model = keras.models.load_model(os.path.join(directory, "m.keras"))
    model.load_weights(os.path.join(directory, "w.weights.h5"))
    for prefix in (
        os.path.join(directory, "ckpt-1"),
        tf.train.latest_checkpoint(os.path.join(directory, "manager")),
    ):
        tf.train.Checkpoint(model=model).read(prefix).assert_existing_objects_matched()
    assert tf.saved_model.load(os.path.join(directory, "sm")) is not None
    np.testing.assert_array_equal(model.get_weights()[0], np.full((FEATURES, UNITS), 0.5))


def test_a_save_no_strategy_owns_makes_no_mpi_call(strategy, shared_dir):
    """Outside any scope, an object that no strategy built: rank 0 saves it
    alone while the other ranks wait in an MPI call of the program's own (a
    barrier). A collective hidden in the save would make both wait for ever
    (a launch that hangs: tests/launchers/test_under_mpiexec.py ends it)."""
    del strategy  # (the world's MPIStrategy exists: these saves are this library's work)
    directory = os.path.join(shared_dir, "unscoped-alone")
    logdir = os.path.join(shared_dir, "logs-alone")
    if RANK == 0:
        model = _unscoped_model()
        for save in UNSCOPED_SAVES.values():
            save(model, directory)
        with tf.summary.create_file_writer(logdir).as_default():  # (names no object)
            tf.summary.scalar("loss", 1.0, step=0)
    WORLD.Barrier()
    _loads_unscoped(directory)
    assert len(os.listdir(logdir)) == 1


def test_saves_no_strategy_owns_are_written_once_per_path_and_complete_on_return(
    strategy, shared_dir
):
    """Every rank saves the same unscoped objects to one path: without the lock
    they race (TensorFlow's ``<prefix>_temp`` staging, a half-written zip).
    Each is written once in all, loads on every rank right after, and the
    directories list only what one process writes; to a directory of its own
    per rank (as node-local disks are), each rank writes."""
    del strategy  # (the world's MPIStrategy exists: these saves are this library's work)
    model = _unscoped_model()
    directory = os.path.join(shared_dir, "unscoped")
    wrote = 0
    for save in UNSCOPED_SAVES.values():
        WORLD.Barrier()  # (the ranks start each save together)
        before = written_bytes()
        save(model, directory)
        wrote += written_bytes() - before
    _loads_unscoped(directory)
    WORLD.Barrier()
    artifact_bytes = sum(
        os.path.getsize(os.path.join(directory, f)) for f in _files_under(directory)
    )
    # Once in all: one rank writes each (the others, in memory, nothing).
    assert WORLD.allreduce(wrote) <= artifact_bytes * 1.25 + SIZE * FIRST_CALL_BYTES
    own = os.path.join(shared_dir, f"rank{RANK}")
    os.makedirs(own)  # (Keras creates no directory)
    before = written_bytes()
    model.save_weights(os.path.join(own, "w.weights.h5"))
    assert written_bytes() - before >= UNITS * FEATURES * 4  # (every rank wrote its copy)
    model.load_weights(os.path.join(own, "w.weights.h5"))
    assert os.listdir(own) == ["w.weights.h5"]
    WORLD.Barrier()
    assert sorted(os.listdir(shared_dir)) == sorted(
        ["unscoped"] + [f"rank{r}" for r in range(SIZE)]
    )


def test_checkpoints_no_strategy_owns_never_race(strategy, shared_dir):
    """As test_checkpoint_saves_on_every_rank_never_race, for a checkpoint of
    a variable that no strategy built: the directory's lock, not a meeting."""
    del strategy
    variable = tf.Variable(tf.zeros([200_000]))
    checkpoint = tf.train.Checkpoint(v=variable)
    prefix = os.path.join(shared_dir, "unscoped-race", "ckpt")
    for step in range(10):  # (without the lock, the first or sixth save failed)
        variable.assign(tf.fill([200_000], float(step)))
        WORLD.Barrier()  # (the ranks start each save together, as in a training loop)
        path = checkpoint.save(prefix)
        variable.assign(tf.zeros([200_000]))
        checkpoint.restore(path).assert_consumed()
        assert float(variable[-1]) == step


def test_where_directories_refuse_the_record_the_ranks_meet(strategy, shared_dir, monkeypatch):
    """A filesystem without extended attributes (NFS before 4.2, ...): every
    rank saving there meets the others instead, and one rank writes."""
    del strategy

    def refused(*args, **kwargs):
        raise OSError(errno.ENOTSUP, "Operation not supported")

    monkeypatch.setattr(os, "setxattr", refused)
    variable = tf.Variable(tf.fill([200_000], float(RANK == 0)))  # (only rank 0's is 1)
    prefix = os.path.join(shared_dir, "refused", "ckpt")
    WORLD.Barrier()
    before = written_bytes()
    path = tf.train.Checkpoint(v=variable).write(prefix)
    wrote = WORLD.allreduce(written_bytes() - before)
    assert wrote <= 800_000 * 1.25 + SIZE * FIRST_CALL_BYTES  # (once in all)
    tf.train.Checkpoint(v=variable).read(path).assert_consumed()
    assert float(variable[0]) == 1.0  # (rank 0's values: the meeting's writer)


def test_an_unknown_save_mode_raises():
    from mpi_strategy._src._tf_internal import Instead, WriteCall
    from mpi_strategy._src.features.saving import calls

    assert all(calls.handler_for(WriteCall("m", "f", "path", mode, None)) for mode in Instead)
    with pytest.raises(mpi_strategy.MPIStrategyError, match="unknown save mode 'memroy'"):
        calls.handler_for(WriteCall("m", "f", "path", "memroy", None))
