"""A save called on every rank writes once per filesystem.

A one-process program saves with, e.g., ``checkpoint.save(prefix)``; run
unchanged on N ranks, every rank makes that call. Each call of a TensorFlow or
Keras function that writes files (listed in ``_tf_internal.WRITE_CALLS`` and
``_keras_internal.SITES``; wrapped by ``calls.py``) is a *write point* when it
belongs to a multi-rank MPIStrategy (``strategy_for``): it runs in its scope,
or writes an object (a model, a checkpoint, a module) whose variables it
built, or, outside any scope, an object that no strategy built. Then:

1. The ranks meet (``WRITE``, tagged with the function and path).
   If only some ranks made the call (``if rank == 0: model.save(...)``), they
   write alone, as the program asked (the lowest of them, if several made the
   same call), and the other ranks meet them again in their next collective,
   or at the end of the program.
2. One rank per filesystem writes (``core/filesystems.py``).
3. The other ranks make the same call against an in-memory path (TensorFlow's
   ``ram://`` filesystem, freed right after): every collective the save needs
   (reading a metric sums it over the ranks) runs on every rank in the same
   order, and they write nothing to disk.
4. The ranks meet again when every rank is done (``WRITE_DONE``): the call
   returns on every rank once every copy is complete, and if any rank failed,
   every rank raises.

A save that belongs to another strategy (made in its scope, or of objects it
built) runs as it would without mpi_strategy, with no MPI call.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import weakref
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from mpi_strategy._src.core import filesystems, kinds
from mpi_strategy._src.core.agreement import Agreement
from mpi_strategy._src.core.errors import MPIStrategyError
from mpi_strategy._src.core.kinds import Kind
from mpi_strategy._src.core.protocol import Field
from mpi_strategy._src.distribute.ordered_comm import OrderedComm
from mpi_strategy._src.distribute.strategy import MPIStrategy, newest_over_the_world

WRITE = kinds.register_kind(
    Kind(
        5,
        "a save",
        meeting=True,
        partial=True,
        solo_label="saving alone",
        solo_advice=(
            "A rank is saving alone (the other ranks did not make the same save call) and "
            "the save reads a value that is summed over all ranks (a metric, or another "
            "sync-on-read variable), which needs every rank. Make the save call on every "
            "rank, as a one-process program does (mpi_strategy writes the files once), or "
            "save only objects without metrics."
        ),
    )
)
WRITE_DONE = kinds.register_kind(
    Kind(
        6,
        "the end of a save",
        meeting=True,
        blame=(
            "A rank left a save before the others (at the end of a save): the save failed "
            "there (see that rank's own error), and its files are not complete."
        ),
    )
)

# What this rank does inside the write point it is in (None: in none);
# NOT_OURS: inside a listed call that is not this library's work, whose
# nested calls (that name no object of their own) are not either.
WRITES, WRITES_ALONE, IN_MEMORY = "writes", "writes alone", "in memory"
NOT_OURS = "not this library's work"
NO_OBJECT = object()  # a call that names no object (a summary writer)
_ERROR_CHARS = 2000

_local = threading.local()
_counter = itertools.count(1)  # next() is atomic under the GIL
_topologies: weakref.WeakKeyDictionary[OrderedComm, filesystems.Topology] = (
    weakref.WeakKeyDictionary()
)


def role() -> str | None:
    """What this rank does in the write point it is in: WRITES, WRITES_ALONE,
    IN_MEMORY, NOT_OURS, or None outside one."""
    return getattr(_local, "role", None)


@contextlib.contextmanager
def not_ours() -> Iterator[None]:
    """The block is a listed call that is not this library's work: the calls
    it makes are not write points either."""
    previous = role()
    _local.role = NOT_OURS
    try:
        yield
    finally:
        _local.role = previous


def alone() -> bool:
    """True inside a write point that only some ranks entered."""
    return getattr(_local, "alone", False)


def strategy_for(written: Any = NO_OBJECT) -> tf.distribute.Strategy | None:
    """The strategy a write belongs to: the one in scope; else the strategy
    that built the variables ``written`` holds; else (an object that no
    strategy built, or a call that names no object, such as a summary writer)
    the newest MPIStrategy over all of ``COMM_WORLD``, as the one-process
    program expects (TensorFlow's own tutorials save such objects from every
    rank to one path); None if none."""
    if tf.distribute.has_strategy():
        return tf.distribute.get_strategy()
    if written is not NO_OBJECT:
        built_by = strategy_of(written, default=tf.distribute.get_strategy())
        if built_by is not None:
            return built_by
    return newest_over_the_world()


def strategy_of(obj: Any, default: tf.distribute.Strategy) -> tf.distribute.Strategy | None:
    """The strategy that built the variables ``obj`` holds (a Keras model, a
    checkpoint, a module, a variable), or None: the object's own if it names
    one, else the first that one of its trackable descendants names; the
    ``default`` strategy (outside any scope) counts as none."""
    found = _named_strategy(obj, default)
    if found is not None or not isinstance(obj, tf.__internal__.tracking.Trackable):
        return found
    for child in tf.train.TrackableView(obj).descendants():
        found = _named_strategy(child, default)
        if found is not None:
            return found
    return None


def _named_strategy(obj: Any, default: tf.distribute.Strategy) -> tf.distribute.Strategy | None:
    # Keras 3 variables hold the (distributed) TensorFlow variable as `.value`.
    for candidate in (obj, getattr(type(obj), "value", None) and getattr(obj, "value", None)):
        strategy = getattr(candidate, "distribute_strategy", None)
        if isinstance(strategy, tf.distribute.Strategy) and strategy is not default:
            return strategy
    return None


def ordered_comm_for(written: Any = NO_OBJECT) -> OrderedComm | None:
    """Where the ranks meet for a write of ``written``: the ordered
    communicator of its multi-rank MPIStrategy (``strategy_for``), or None
    when the write is not this library's work (it then runs unchanged)."""
    return ordered_comm_of(strategy_for(written))


def ordered_comm_of(strategy: tf.distribute.Strategy | None) -> OrderedComm | None:
    """``strategy``'s ordered communicator if it is a multi-rank MPIStrategy
    whose collectives are usable, else None."""
    if not isinstance(strategy, MPIStrategy):
        return None
    ordered = strategy.extended.ordered_comm
    if ordered.size == 1 or not ordered.agreement.usable:
        return None
    return ordered


def applies(path: Any, written: Any = NO_OBJECT) -> OrderedComm | None:
    """The ordered communicator on which a call writing ``path`` (holding
    ``written``) is a write point, or None if it runs unchanged."""
    if (
        role() is not None
        or not isinstance(path, (str, os.PathLike))
        or os.fspath(path).startswith("ram://")
        or not tf.executing_eagerly()
    ):
        return None
    return ordered_comm_for(written)


@contextlib.contextmanager
def write_point(ordered: OrderedComm, path: str | os.PathLike[str], what: str) -> Iterator[None]:
    """The block writes ``path`` if ``role()`` is WRITES or WRITES_ALONE inside it.

    ``what`` names the call (e.g. "tf.train.Checkpoint.write"); the ranks of
    ``ordered`` that make it meet. If they name different paths (programs
    written for other strategies send non-chief writes to temporary paths),
    each path is written by the lowest rank naming it. With role IN_MEMORY the
    block must make the same call without writing to disk (``calls.py``).
    An exception (not a ``KeyboardInterrupt`` or ``SystemExit``: they end the
    job) meets the other ranks after the block too, and is raised everywhere.
    """
    path = os.fspath(path)
    agreement = ordered.agreement
    everyone = agreement.agree(WRITE, np.uint8, [], tag=what, nbytes=zlib.crc32(path.encode()))
    if everyone is None:
        # Made on some ranks only: they write, as the program asked; if several
        # made this very call, the lowest of them writes (they would race).
        solo_role = WRITES_ALONE if agreement.solo_with[0] == ordered.rank else IN_MEMORY
        with _in_role(solo_role, agreement, alone=True):
            yield
        return
    paths = everyone[:, Field.BYTES]
    if np.all(paths == paths[0]):
        writes = _topology(ordered).writer_rank(path) == ordered.rank
    else:  # each rank named its own path (e.g. per-worker temporary directories)
        writes = int(np.flatnonzero(paths == paths[ordered.rank])[0]) == ordered.rank
    try:
        with _in_role(WRITES if writes else IN_MEMORY, agreement):
            yield
    except Exception as exc:
        # Every rank meets again, except one whose error came from meeting
        # there a rank that failed earlier in the save.
        if WRITE_DONE not in agreement.disagreed:
            _meet_after(ordered, what, path, f"{type(exc).__name__}: {exc}")
        raise
    _meet_after(ordered, what, path, "")


def _topology(ordered: OrderedComm) -> filesystems.Topology:
    if ordered not in _topologies:
        _topologies[ordered] = filesystems.Topology(ordered.comm)
    return _topologies[ordered]


@contextlib.contextmanager
def _in_role(current: str, agreement: Agreement, alone: bool = False) -> Iterator[None]:
    _local.role, _local.alone = current, alone
    agreement.solo = WRITE if alone else None
    try:
        yield
    finally:
        _local.role, _local.alone = None, False
        agreement.solo = None


def memory_path(path: str | os.PathLike[str]) -> str:
    """A fresh in-memory path (TensorFlow's ``ram://``) named like ``path``."""
    name = os.path.basename(os.path.normpath(path)) or "saved"
    return f"ram://mpi_strategy/{os.getpid()}/{next(_counter)}/{name}"


def remove_memory_path(path: str) -> None:
    """Frees what was written under ``memory_path``'s result ``path``."""
    root = path.rsplit("/", 1)[0]
    try:
        if tf.io.gfile.exists(root):
            tf.io.gfile.rmtree(root)
    except tf.errors.OpError:
        pass  # memory only, freed with the process: nothing on disk is left behind


def _meet_after(ordered: OrderedComm, what: str, path: str, failure: str) -> None:
    """Every rank waits for every other; a failure anywhere raises everywhere."""
    failure = failure[:_ERROR_CHARS]
    everyone = ordered.agreement.agree(WRITE_DONE, np.uint8, [], nbytes=len(failure))
    assert everyone is not None  # (not a partial kind)
    if not everyone[:, Field.BYTES].any():
        return
    texts = filesystems.allgather_text(ordered.comm, failure)
    if failure:
        return  # this rank re-raises its own exception
    failed = [f"rank {r}: {text}" for r, text in enumerate(texts) if text]
    raise MPIStrategyError(
        f"mpi_strategy: {what}({path!r}) failed on another rank, so it is not "
        f"complete: {'; '.join(failed)}"
    )
