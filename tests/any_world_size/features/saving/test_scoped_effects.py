"""effects.py and features/saving/write_point.py: process-wide effects act only on
this library's work (docs/concepts.md, "Process-wide effects"): in a process
that holds a multi-rank MPIStrategy, a save that belongs to another strategy
(made in its scope, or of objects it built) writes on its own, on every rank
that makes it, with no MPI call; one of this library's saves still meets.
"""

import contextlib
import os
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from mpi_strategy._src.core.agreement import Agreement
from mpi_strategy._src.features.saving import write_point
from mpi_testing import RANK, SIZE, WORLD

SAVES = {
    "Checkpoint.save": lambda v, path: tf.train.Checkpoint(v=v).save(path),
    "CheckpointManager.save": lambda v, path: tf.train.CheckpointManager(
        tf.train.Checkpoint(v=v), path, 1
    ).save(),
    "tf.saved_model.save": lambda v, path: tf.saved_model.save(_module_of(v), path),
    "summary writer": lambda v, path: _write_summary(v, path),
}


def _module_of(variable):
    module = tf.Module()
    module.v = variable
    return module


def _write_summary(variable, path):
    with tf.summary.create_file_writer(path).as_default():
        tf.summary.scalar("v", variable[0], step=0)


@pytest.fixture
def meetings(monkeypatch):
    """Every meeting of the ranks (the start of each collective and write
    point) raises at once instead of waiting for other ranks."""
    met = []

    def agree(self, kind, *args, **kwargs):
        met.append(kind.name)
        raise AssertionError(
            f"an MPI meeting ({kind.name}) in a save that is not mpi_strategy's work"
        )

    monkeypatch.setattr(Agreement, "agree", agree)
    return met


def _mirrored():
    return tf.distribute.MirroredStrategy(["/cpu:0"])


@pytest.mark.parametrize("where", ["in its scope", "built in its scope"])
@pytest.mark.parametrize("api", list(SAVES))
def test_a_save_of_another_strategy_writes_alone_on_every_rank(
    strategy, tmp_path, meetings, where, api
):
    """Under MirroredStrategy: saved in its scope, or built there and saved
    outside any scope."""
    del strategy  # held by this process: a multi-rank MPIStrategy when SIZE > 1
    if api == "summary writer" and where != "in its scope":
        pytest.skip("a summary writer names no object: only a scope tells whose it is")
    mirrored = _mirrored()
    with mirrored.scope():
        variable = tf.Variable(tf.fill([1000], float(RANK)))
    with mirrored.scope() if where == "in its scope" else contextlib.nullcontext():
        SAVES[api](variable, str(tmp_path / "saved"))
    assert meetings == []
    written = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files]
    least = 100 if api == "summary writer" else 4000  # the 1000 floats, for a checkpoint
    assert sum(os.path.getsize(f) for f in written) > least, written  # here, not in memory


def test_a_keras_model_of_another_strategy_saves_alone(strategy, tmp_path, meetings):
    del strategy
    with _mirrored().scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.save(str(tmp_path / "model.keras"))
    model.save_weights(str(tmp_path / "model.weights.h5"))
    assert meetings == [] and sorted(os.listdir(tmp_path)) == ["model.keras", "model.weights.h5"]


def test_rank0_saving_alone_while_the_others_wait_for_its_own_message(strategy, tmp_path, meetings):
    """The program's own MPI calls around a save that is not this library's
    work: rank 0 saves a MirroredStrategy model, then tells the others (a
    hidden collective in the save would leave rank 0 waiting for them, and
    them for its message)."""
    del strategy
    if SIZE == 1:
        pytest.skip("needs other ranks")
    message = np.zeros(1, np.int64)
    if RANK == 0:
        with _mirrored().scope():
            variable = tf.Variable(tf.ones([1000]))
        tf.train.Checkpoint(v=variable).save(str(tmp_path / "ckpt"))
        requests = [WORLD.Isend(np.ones(1, np.int64), dest=r, tag=41) for r in range(1, SIZE)]
        for request in requests:
            request.Wait()
        return
    request = WORLD.Irecv(message, source=0, tag=41)
    deadline = time.monotonic() + 120
    while not request.Test():
        assert time.monotonic() < deadline, "rank 0 never finished its save"
        time.sleep(0.01)
    assert message[0] == 1


def test_an_object_no_strategy_built_is_saved_once_for_all_ranks(strategy, shared_dir):
    """As the one-process program (and TensorFlow's save_and_load tutorial, a
    subclassed model built outside any scope, saved by every rank to one
    path) expects: outside any scope it belongs to the world's MPIStrategy."""
    expected = strategy.extended.ordered_comm if SIZE > 1 else None
    module = tf.Module()
    module.v = tf.Variable(tf.ones([1000]))
    assert write_point.ordered_comm_for(module) is expected
    path = os.path.join(shared_dir, "plain")
    tf.saved_model.save(module, path)
    assert float(tf.saved_model.load(path).v[0]) == 1.0


def test_this_librarys_save_outside_its_scope_still_meets(strategy, shared_dir):
    """The positive control: a checkpoint of the strategy's variables, saved
    outside its scope, is a write point (one writer, every rank meets)."""
    with strategy.scope():
        variable = tf.Variable(tf.ones([10]))
    checkpoint = tf.train.Checkpoint(v=variable)
    expected = strategy if SIZE > 1 else None
    assert write_point.ordered_comm_for(checkpoint) is (
        expected.extended.ordered_comm if expected else None
    )
    path = checkpoint.save(os.path.join(shared_dir, "ours", "ckpt"))
    assert os.path.exists(path + ".index")


def test_a_keyboard_interrupt_in_a_save_leads_into_no_collective(strategy, shared_dir, monkeypatch):
    """Ctrl-C during a save ends the job like any uncaught exception (the
    excepthook): the ranks do not meet after the save first."""
    met_after = []
    monkeypatch.setattr(write_point, "meet_after", lambda *args: met_after.append(args))

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    with strategy.scope():
        variable = tf.Variable(tf.ones([10]))
    checkpoint = tf.train.Checkpoint(v=variable)
    from tensorflow.python.checkpoint import checkpoint as checkpoint_lib

    monkeypatch.setattr(checkpoint_lib.TrackableSaver, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.write(os.path.join(shared_dir, "interrupted", "ckpt"))
    assert met_after == []
