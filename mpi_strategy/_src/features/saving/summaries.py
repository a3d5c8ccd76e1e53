"""A summary writer's events are on disk on every rank when a flush returns.

``tf.summary.create_file_writer`` is a write point (``calls.py``): on each
filesystem one rank gets TensorFlow's writer, the others a ``StandIn`` that
writes nothing. Events reach the file when the writing rank flushes:
``flush()``, ``close()``, the end of a ``with writer.as_default():`` block
(TensorFlow flushes there) and ``tf.summary.flush(writer)``. So each flush of
a stand-in returns only once the writing rank's flush of the same number (the
ranks make the same calls) is done, and every rank can read the events back
right after (``track`` counts the writing rank's flushes).

How the ranks learn it follows the write point the writer was created in
(``write_point.py``), so that it makes no more MPI calls than the creation:

* created under the directory's lock (outside any scope, no strategy owns a
  writer): no MPI call. After each flush the writing rank records how many of
  its flushes are done in an extended attribute of that directory
  (``_FLUSHES``, beside the record of saves); a stand-in reads it until its
  flush is there, or the writer is closed, or ``WAIT_SECONDS`` passed: a flush
  made on some ranks only (the writing rank never makes it) then returns with
  a warning instead of hanging.
* created where the ranks met (in a strategy's scope, a remote path, a
  filesystem refusing the lock): every flush is a partial meeting of the
  ranks, the writing rank's after its flush; a flush made on some ranks only
  meets the others in their next collective, as a save does. None where the
  writer was created on some ranks only.

Inside a ``tf.function`` the flush is an op: under the directory's lock the
record and the wait are ops too (``tf.py_function``, run when the flush runs);
where the ranks met, nothing is waited for there (a meeting cannot run inside
a graph beside the strategy's ordered collectives): flush outside the function.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from mpi_strategy._src.core import kinds
from mpi_strategy._src.core.kinds import Kind
from mpi_strategy._src.core.logs import logger
from mpi_strategy._src.features.saving import write_point

FLUSH = kinds.register_kind(
    Kind(
        14,
        "the flush of a summary writer",
        meeting=True,
        partial=True,
        solo_label="flushing a summary writer alone",
    )
)

# {"job": ..., "flushed": {save: [flushes done, closed]}}, save naming the
# writer as write_point.Locked does; the _KEPT newest writers of the job.
_FLUSHES = "user.mpi_strategy.flushes"
_KEPT = 16
WAIT_SECONDS = 60.0  # how long a stand-in waits for the writing rank's flush
_POLL_SECONDS = (0.0005, 0.02)  # first and longest sleep between reads of the record


class Flushes:
    """One writer as every rank created it: how many flushes this rank made of
    it, and how the ranks learn that the writing rank's are done."""

    def __init__(self, where: write_point.Locked | write_point.Met, logdir: str) -> None:
        self.where, self.logdir = where, logdir
        self.closed = False
        self.closing = False  # (the writing rank's flush inside its close)
        self._made = 0
        self._lock = threading.Lock()  # (a graph's flushes may run in any thread)

    def next(self) -> int:
        """Counts one more flush of this rank; returns its number."""
        with self._lock:
            self._made += 1
            return self._made

    def done(self) -> None:
        """The writing rank: its flush (in its close: and it is closed) is done."""
        number = self.next()
        if isinstance(self.where, write_point.Met):
            self._meet()
        else:
            _record(self.where, number, closed=self.closing)

    def wait(self) -> None:
        """A stand-in: returns once the writing rank's flush of the same number is done."""
        number = self.next()
        if isinstance(self.where, write_point.Met):
            self._meet()
        else:
            _wait(self.where, number, self.logdir)

    def in_graph(self, after: Any, writes: bool) -> Any:
        """``done`` (``writes``) or ``wait`` as an op that runs after ``after``
        (None: none) each time the traced function runs."""
        if isinstance(self.where, write_point.Met):
            return after if after is not None else tf.no_op()
        action = self.done if writes else self.wait
        with tf.control_dependencies([after] if after is not None else []):
            return tf.py_function(lambda: (action(), True)[1], [], tf.bool)

    def _meet(self) -> None:
        assert isinstance(self.where, write_point.Met)
        if self.where.alone or not tf.executing_eagerly():
            return  # (no meeting: created on some ranks only, or inside a graph)
        self.where.ordered.agreement.agree(FLUSH, np.uint8, [], tag=self.logdir)


def _record(where: write_point.Locked, number: int, closed: bool) -> None:
    with write_point.locked(where.directory) as fd:
        if fd is None:
            return  # (refused now, taken when the writer was made: stand-ins wait WAIT_SECONDS)
        flushed = _flushed(fd, where.job)
        flushed.pop(where.save, None)  # (re-inserted last: the newest are kept)
        flushed[where.save] = [number, closed]
        kept = dict(list(flushed.items())[-_KEPT:])
        try:
            os.setxattr(fd, _FLUSHES, json.dumps({"job": where.job, "flushed": kept}).encode())
        except OSError as exc:
            logger.warning(
                "mpi_strategy: a summary writer's flush in %s could not be recorded (%s): "
                "the other ranks' flushes wait for it %s s",
                where.directory,
                exc,
                WAIT_SECONDS,
            )


def _flushed(fd: int | str, job: str) -> dict[str, list[Any]]:
    """{save: [flushes done, closed]} of this job's writers, as recorded."""
    try:
        record = json.loads(write_point.read_attribute(fd, _FLUSHES))
        return dict(record["flushed"]) if record["job"] == job else {}
    except (ValueError, KeyError, TypeError, OSError):
        return {}  # empty (new), or another job's: nothing recorded


def _wait(where: write_point.Locked, number: int, logdir: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    pause = _POLL_SECONDS[0]
    while True:
        done, closed = _flushed(where.directory, where.job).get(where.save, [0, False])
        if done >= number or closed:
            return
        if time.monotonic() > deadline:
            logger.warning(
                "mpi_strategy: waited %s s in a flush of the summary writer of %s for the "
                "rank that writes its events to make the same flush (its flush number %d): "
                "going on, its events may not be complete yet. Flush (and close, and end "
                "`as_default()` blocks of) a writer on every rank that created it.",
                WAIT_SECONDS,
                logdir,
                number,
            )
            return
        time.sleep(pause)
        pause = min(2 * pause, _POLL_SECONDS[1])


def track(writer: Any, logdir: str) -> Any:
    """TensorFlow's ``writer`` on the rank that writes (inside the write point
    that created it): its flushes, and so its ``close`` and the end of its
    ``as_default`` blocks, also tell the stand-ins they are done."""
    where = write_point.where()
    if where is None or not hasattr(writer, "flush") or not hasattr(writer, "close"):
        return writer
    flushes = Flushes(where, os.fspath(logdir))
    # (a weak reference: the writer's resource is freed when the program drops it)
    own = weakref.ref(writer)
    flush, close = type(writer).flush, type(writer).close

    def flushing() -> Any:
        if flushes.closed and tf.executing_eagerly():
            return flush(own())  # (a closed writer's flush does nothing)
        result = flush(own())
        if not tf.executing_eagerly():
            return flushes.in_graph(result, writes=True)
        flushes.done()
        return result

    def closing() -> Any:
        if not tf.executing_eagerly() or flushes.closed:
            return close(own())
        flushes.closing = True
        try:
            return close(own())  # (calls flushing first)
        finally:
            flushes.closed, flushes.closing = True, False

    writer.flush, writer.close = flushing, closing
    return writer


def stand_in(logdir: Any) -> tf.summary.SummaryWriter:
    """What a rank that does not write gets instead of a file writer for
    ``logdir`` (inside the write point that created it): a ``StandIn``, or,
    outside any write point, TensorFlow's writer that does nothing."""
    where = write_point.where()
    if where is None:
        return tf.summary.create_noop_writer()
    return StandIn(Flushes(where, os.fspath(logdir)))


class StandIn(tf.summary.SummaryWriter):
    """A summary writer that writes nothing (as ``tf.summary.create_noop_writer()``)
    and whose flushes return once the writing rank's same flush is done. As
    TensorFlow's writer, it flushes at the end of ``as_default`` blocks and in
    ``close``, and refuses ``as_default`` once closed (eagerly)."""

    def __init__(self, flushes: Flushes) -> None:
        self._flushes = flushes

    def set_as_default(self, step: Any = None) -> None:
        self._check_open()

    @contextlib.contextmanager
    def as_default(self, step: Any = None) -> Iterator[StandIn]:
        self._check_open()
        try:
            yield self
        finally:
            self.flush()

    def init(self) -> None:
        self._check_open()

    def flush(self) -> Any:
        if not tf.executing_eagerly():
            return self._flushes.in_graph(None, writes=False)
        if not self._flushes.closed:
            self._flushes.wait()
        return None

    def close(self) -> Any:
        if not tf.executing_eagerly():
            return self.flush()
        if not self._flushes.closed:
            self.flush()
            self._flushes.closed = True
        return None

    def _check_open(self) -> None:
        if self._flushes.closed and tf.executing_eagerly():
            raise RuntimeError(f"SummaryWriter {self!r} is already closed")
