"""features/saving/summaries.py: the events a summary writer writes on one rank
are on disk on every rank when a flush returns there.

Every rank creates the writer, writes, flushes in one of the ways TensorFlow
flushes (``flush()``, ``close()``, the end of an ``as_default()`` block,
``tf.summary.flush(writer)``, a flush inside a ``tf.function``) and reads the
event file back at once: the rank that does not write used to return before
the writing rank's events were on disk (short in most rounds), so each way is
repeated. Outside any scope (the directory's lock, no MPI call) and in the
strategy's scope (the ranks meet). A flush made on some ranks only returns.
"""

import contextlib
import logging
import os

import numpy as np
import pytest
import tensorflow as tf

from mpi_strategy._src.core.logs import logger
from mpi_strategy._src.features.saving import summaries
from mpi_testing import RANK, SIZE, WORLD, gather_from_all_ranks

ROUNDS, STEPS = 20, 8


def _events(logdir):
    """[(step, value)] of the scalar "x" in the event files of ``logdir``, as read now."""
    found = []
    for name in sorted(os.listdir(logdir)):
        for event in tf.compat.v1.train.summary_iterator(os.path.join(logdir, name)):
            found += [
                (event.step, float(tf.make_ndarray(v.tensor)))
                for v in event.summary.value
                if v.tag == "x"
            ]
    return found


def _scalars():
    for step in range(STEPS):
        tf.summary.scalar("x", float(step), step=step)


@tf.function
def _flush_in_graph(writer):
    writer.flush()


def _as_default_end(writer):
    with writer.as_default():
        _scalars()


def _then(flush):
    def write_and_flush(writer):
        with writer.as_default():
            _scalars()
            flush(writer)

    return write_and_flush


# how: writes STEPS scalars with writer and flushes them in that way
FLUSHES = {
    "flush()": _then(lambda w: w.flush()),
    "close()": _then(lambda w: w.close()),
    "the end of as_default()": _as_default_end,
    "tf.summary.flush(writer)": _then(lambda w: tf.summary.flush(w)),
    "a flush inside a tf.function": _then(_flush_in_graph),
}


@pytest.mark.parametrize("scoped", [False, True], ids=["outside any scope", "in the scope"])
@pytest.mark.parametrize("how", list(FLUSHES))
def test_every_rank_reads_the_events_back_right_after_the_flush(strategy, shared_dir, how, scoped):
    if scoped and how == "a flush inside a tf.function":
        pytest.skip("where the ranks met, a flush inside a graph does not wait (summaries.py)")
    expected = [(step, float(step)) for step in range(STEPS)]
    short = []
    for attempt in range(ROUNDS):
        logdir = os.path.join(shared_dir, f"logs{attempt}")
        with strategy.scope() if scoped else contextlib.nullcontext():
            writer = tf.summary.create_file_writer(logdir)
        FLUSHES[how](writer)
        read = _events(logdir)  # (right after the flush, on every rank)
        if read != expected:
            short.append((attempt, len(read)))
    everyone = gather_from_all_ranks(np.array(len(short)))
    assert not everyone.any(), f"rounds short of events per rank: {everyone.tolist()}: {short}"


def test_a_flush_on_some_ranks_only_returns(strategy, shared_dir, monkeypatch):
    """Outside any scope only the ranks that do not write flush: they wait
    for the writing rank's flush (WAIT_SECONDS, shortened here), warn and go
    on. In the scope, rank 0 alone flushes: it meets the others in their
    next collective."""
    monkeypatch.setattr(summaries, "WAIT_SECONDS", 0.5)
    writer = tf.summary.create_file_writer(os.path.join(shared_dir, "alone"))
    stand_in = isinstance(writer, summaries.StandIn)
    assert WORLD.allreduce(int(stand_in)) == SIZE - 1  # (one rank writes, on one filesystem)
    warned = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)  # (ranks but 0 show errors only)
    try:
        if stand_in:
            writer.flush()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert any("its events may not be complete" in text for text in warned) == stand_in
    with strategy.scope():
        scoped = tf.summary.create_file_writer(os.path.join(shared_dir, "scoped"))
    if RANK == 0:
        scoped.flush()
    strategy.reduce("SUM", tf.constant(1.0), axis=None)  # (the others' next collective)
    WORLD.Barrier()
