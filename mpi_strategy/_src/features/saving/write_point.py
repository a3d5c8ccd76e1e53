"""A save called on every rank writes once per filesystem.

A one-process program saves with, e.g., ``checkpoint.save(prefix)``; run
unchanged on N ranks, every rank makes that call. Each call of a TensorFlow or
Keras function that writes files (listed in ``_tf_internal.WRITE_CALLS`` and
``_keras_internal.SITES``; wrapped by ``calls.py``) is a *write point* when it
is this library's work (``point_for``). Two kinds:

A save that belongs to a multi-rank MPIStrategy (``owner_of``: made in its
scope, or of an object whose variables it built) meets the other ranks:

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

A save that no strategy owns (outside any scope, of an object that no
strategy built, or naming no object, as a summary writer), in a job with a
multi-rank MPIStrategy over the world, makes no MPI call
(``locked_write_point``): it needs no other rank, so a rank may make it alone
while the others wait in MPI calls of the program's own. The ranks that make
it take turns under a lock of the destination's directory (``flock``); the
first of a filesystem writes the real path, in place, as one process does,
and records in an extended attribute of that directory that this job's n-th
save of that name is written; the others then find it recorded and make the
call against an in-memory path, as in 3. Every rank returns once that copy is
complete. Nothing is added to the directory's listing. Where the filesystem
refuses the lock or the attribute, the ranks meet as above.

A save that belongs to another strategy (made in its scope, or of objects it
built) runs as it would without mpi_strategy, with no MPI call.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import json
import os
import re
import threading
import weakref
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf

from mpi_strategy._src.core import filesystems, kinds
from mpi_strategy._src.core.agreement import Agreement
from mpi_strategy._src.core.errors import MPIStrategyError
from mpi_strategy._src.core.kinds import Kind
from mpi_strategy._src.core.logs import logger
from mpi_strategy._src.core.process import PROCESS
from mpi_strategy._src.core.protocol import Field
from mpi_strategy._src.distribute.ordered_comm import OrderedComm
from mpi_strategy._src.distribute.strategy import MPIStrategy, job_id, newest_over_the_world

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

_local = threading.local()  # the role of the save under way, per thread


@dataclass
class SavingState:
    """Saving's part of the process state (``PROCESS.of``)."""

    # names of in-memory copies; next() is atomic under the GIL
    counter: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    # in-memory copy being written -> the real path it stands for
    copies: dict[str, str] = field(default_factory=dict)
    # which ranks share a filesystem, per ordered communicator
    topologies: weakref.WeakKeyDictionary[OrderedComm, filesystems.Topology] = field(
        default_factory=weakref.WeakKeyDictionary
    )
    # path: this process's saves of it that no strategy owns
    saves_made: dict[str, int] = field(default_factory=dict)
    # directories without the lock or the record (warned about once)
    refused: set[str] = field(default_factory=set)


def _state() -> SavingState:
    return PROCESS.of(SavingState)


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


@dataclass(frozen=True)
class Locked:
    """A write point under the lock of ``directory``: this job's n-th save of
    one name there (``save``: the name's key and n), made on this rank."""

    directory: str
    save: str
    job: str


@dataclass(frozen=True)
class Met:
    """A write point where the ranks of ``ordered`` met (``alone``: only some did)."""

    ordered: OrderedComm
    alone: bool


def where() -> Locked | Met | None:
    """The write point this rank is in, as ``Locked`` or ``Met`` (None: in none)."""
    return getattr(_local, "where", None)


def strategy_for(written: Any = NO_OBJECT) -> tf.distribute.Strategy | None:
    """The strategy a write is this library's work for: its owner
    (``owner_of``), else (an object that no strategy built, or a call that
    names no object, such as a summary writer) the newest MPIStrategy over all
    of ``COMM_WORLD``, as the one-process program expects (TensorFlow's own
    tutorials save such objects from every rank to one path); None if none."""
    return owner_of(written) or newest_over_the_world()


def owner_of(written: Any = NO_OBJECT) -> tf.distribute.Strategy | None:
    """The strategy a write belongs to: the one in scope; else the strategy
    that built the variables ``written`` holds; None if neither."""
    if tf.distribute.has_strategy():
        return tf.distribute.get_strategy()
    if written is NO_OBJECT:
        return None
    return strategy_of(written, default=tf.distribute.get_strategy())


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
    """The ordered communicator of the multi-rank MPIStrategy a write of
    ``written`` is this library's work for (``strategy_for``), or None when it
    is not (it then runs unchanged)."""
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


def point_for(path: Any, written: Any, what: str) -> contextlib.AbstractContextManager[None] | None:
    """The write point a call ``what`` writing ``path`` (holding ``written``)
    is, or None if it runs unchanged: its owner's meeting (``write_point``);
    for a local path that no strategy owns, the directory's lock
    (``locked_write_point``); for a remote one, the world's meeting (no lock
    spans an object store)."""
    if (
        role() is not None
        or not isinstance(path, (str, os.PathLike))
        or os.fspath(path).startswith("ram://")
        or not tf.executing_eagerly()
    ):
        return None
    owner = owner_of(written)
    ordered = ordered_comm_of(owner or newest_over_the_world())
    job = job_id()
    if ordered is None:
        return None
    if owner is not None or _REMOTE.match(os.fspath(path)) or job is None:
        return write_point(ordered, path, what)
    return locked_write_point(ordered, path, what, job)


_REMOTE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


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
        with _in_role(solo_role, agreement, alone=True, where=Met(ordered, alone=True)):
            yield
        return
    paths = everyone[:, Field.BYTES]
    if np.all(paths == paths[0]):
        writes = _topology(ordered).writer_rank(path) == ordered.rank
    else:  # each rank named its own path (e.g. per-worker temporary directories)
        writes = int(np.flatnonzero(paths == paths[ordered.rank])[0]) == ordered.rank
    try:
        with _in_role(WRITES if writes else IN_MEMORY, agreement, where=Met(ordered, alone=False)):
            yield
    except Exception as exc:
        # Every rank meets again, except one whose error came from meeting
        # there a rank that failed earlier in the save.
        if WRITE_DONE not in agreement.disagreed:
            meet_after(ordered, what, path, f"{type(exc).__name__}: {exc}")
        raise
    meet_after(ordered, what, path, "")


def _topology(ordered: OrderedComm) -> filesystems.Topology:
    topologies = _state().topologies
    if ordered not in topologies:
        topologies[ordered] = filesystems.Topology(ordered.comm)
    return topologies[ordered]


@contextlib.contextmanager
def _in_role(
    current: str,
    agreement: Agreement | None = None,
    alone: bool = False,
    where: Locked | Met | None = None,
) -> Iterator[None]:
    _local.role, _local.alone, _local.where = current, alone, where
    if agreement is not None:
        agreement.solo = WRITE if alone else None
    try:
        yield
    finally:
        _local.role, _local.alone, _local.where = None, False, None
        if agreement is not None:
            agreement.solo = None


@contextlib.contextmanager
def locked_write_point(
    ordered: OrderedComm, path: str | os.PathLike[str], what: str, job: str
) -> Iterator[None]:
    """The block writes ``path`` if ``role()`` is WRITES inside it; no MPI call.

    This rank's n-th such save of ``path`` locks the directory that holds it
    (``flock`` on the directory itself) and writes, unless the record of that
    directory (an extended attribute, ``_RECORD``) says that this job's n-th
    save of that name is written; it then records it. A rank that finds it
    recorded (another rank wrote it, on this filesystem) gets role IN_MEMORY
    once the writer let go of the lock: the copy is complete when the block
    starts. A failed write records nothing: the next rank to come writes.
    Where the filesystem refuses the lock or the record, every rank saving
    there does so alike, and they meet instead (``write_point``).
    """
    full = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(full)
    key = hashlib.blake2b(name.encode(), digest_size=8).hexdigest()
    with _process_lock:
        saves_made = _state().saves_made
        saves = saves_made[full] = saves_made.get(full, 0) + 1
    here = Locked(directory, f"{key}.{saves}", job)
    with locked(directory) as lock:
        if lock is not None:
            saved = _recorded(lock, job)
            if saved.get(key, 0) < saves:
                with _in_role(WRITES, where=here):
                    yield
                saved.pop(key, None)  # (re-inserted last: the newest are kept)
                _record(lock, job, dict(saved, **{key: saves}), full)
                return
    if lock is None:  # (the filesystem refuses flock or extended attributes)
        with write_point(ordered, path, what):
            yield
        return
    with _in_role(IN_MEMORY, where=here):
        yield


# An extended attribute of the directory that holds the saved path: invisible
# to a listing (a file there would be seen by programs that list it, such as
# TensorBoard's), gone with the directory. {"job": ..., "saved": {key: n}}
# where key hashes a name of that directory and n counts this job's saves of
# it that are written; at most _KEPT names (an ext4 inode holds ~4 KB of them).
_RECORD = "user.mpi_strategy.saves"
_KEPT = 64
_process_lock = threading.Lock()


@contextlib.contextmanager
def locked(directory: str) -> Iterator[int | None]:
    """Holds the lock of ``directory`` (created if missing, as a TensorFlow
    save would) and yields its descriptor, or None, unlocked, where the
    filesystem refuses ``flock`` on a directory or this record (NFS, a sticky
    directory of another user, ...). ``flock`` locks each open descriptor:
    threads of this process exclude each other too."""
    os.makedirs(directory, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.setxattr(fd, _RECORD, read_attribute(fd) or b"{}")  # (can it be written here?)
        except OSError as exc:
            if directory not in _state().refused:  # (once per directory)
                _state().refused.add(directory)
                logger.warning(
                    "mpi_strategy: %s refuses a lock or an extended attribute (%s): saves "
                    "there of objects that no strategy built meet the other ranks "
                    "(docs/checkpointing.md, Limits)",
                    directory,
                    exc,
                )
            yield None
            return
        yield fd
    finally:
        os.close(fd)  # (lets go of the lock)


def read_attribute(fd: int | str, attribute: str = _RECORD) -> bytes:
    """The extended attribute ``attribute`` of ``fd`` (a descriptor or a path), b"" if unset."""
    try:
        return os.getxattr(fd, attribute)
    except OSError as exc:
        if exc.errno != errno.ENODATA:
            raise
        return b""


def _recorded(fd: int, job: str) -> dict[str, int]:
    """{key: how many saves of its name are written} in this job, as recorded."""
    try:
        record = json.loads(read_attribute(fd))
        return dict(record["saved"]) if record["job"] == job else {}
    except (ValueError, KeyError, TypeError):
        return {}  # empty (new), or another job's: nothing recorded


def _record(fd: int, job: str, saved: dict[str, int], path: str) -> None:
    """Records ``saved``, the oldest names first dropped where it does not fit
    (a rank that many saves behind writes its copy again)."""
    kept = list(saved.items())[-_KEPT:]
    while True:
        try:
            os.setxattr(fd, _RECORD, json.dumps({"job": job, "saved": dict(kept)}).encode())
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.E2BIG) or len(kept) <= 1:
                logger.warning(
                    "mpi_strategy: %s is written, but could not be recorded (%s): "
                    "another rank saving it will write it again",
                    path,
                    exc,
                )
                return
            kept = kept[len(kept) // 2 :]


def memory_path(path: str | os.PathLike[str]) -> str:
    """A fresh in-memory path (TensorFlow's ``ram://``) named like ``path``."""
    name = os.path.basename(os.path.normpath(path)) or "saved"
    copy = f"ram://mpi_strategy/{os.getpid()}/{next(_state().counter)}/{name}"
    _state().copies[copy] = os.fspath(path)
    return copy


def real_path(path: str) -> str | None:
    """The real path that ``path``, in an in-memory copy being written
    (``memory_path``), stands for; None for any other path. (A save nested in
    such a copy, e.g. the variables of ``tf.saved_model.save``, may need to
    write its part where the ranks that write put the real files.)"""
    for copy, real in list(_state().copies.items()):
        if path == copy or path.startswith(copy + "/"):
            return real + path[len(copy) :]
    return None


def remove_memory_path(path: str) -> None:
    """Frees what was written under ``memory_path``'s result ``path``."""
    _state().copies.pop(path, None)
    root = path.rsplit("/", 1)[0]
    try:
        if tf.io.gfile.exists(root):
            tf.io.gfile.rmtree(root)
    except tf.errors.OpError:
        pass  # memory only, freed with the process: nothing on disk is left behind


def meet_after(
    ordered: OrderedComm, what: str, path: str, failure: str, kind: Kind = WRITE_DONE
) -> None:
    """Every rank waits for every other (in a meeting of ``kind``); a failure
    anywhere (this rank's ``failure``, "" if none) raises everywhere."""
    failure = failure[:_ERROR_CHARS]
    everyone = ordered.agreement.agree(kind, np.uint8, [], nbytes=len(failure))
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
