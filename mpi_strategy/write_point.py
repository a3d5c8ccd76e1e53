"""A save called on every rank writes once per filesystem.

A one-process program saves with, e.g., ``checkpoint.save(prefix)``; run
unchanged on N ranks, every rank makes that call. Each call of a TensorFlow or
Keras function that writes files (the list is in ``saving.py``) is a *write
point*:

1. The ranks meet (``rendezvous.WRITE``, tagged with the function and path).
   If only some ranks made the call (``if rank == 0: model.save(...)``), they
   write alone, as the program asked (the lowest of them, if several made the
   same call), and the other ranks meet them again in their next collective,
   or at the end of the program.
2. One rank per filesystem writes: rank 0 when every rank sees the path's
   directory (a shared filesystem), else the lowest rank that sees each copy
   (node-local disks), found once per directory by a probe file.
3. The other ranks make the same call against an in-memory path (TensorFlow's
   ``ram://`` filesystem, freed right after): every collective the save needs
   (reading a metric sums it over the ranks) runs on every rank in the same
   order, and they write nothing to disk.
4. The ranks meet again when every rank is done: the call returns on every rank
   once every copy is complete, and if any rank failed, every rank raises.
"""

import atexit
import contextlib
import itertools
import os
import sys
import threading
import time
import zlib

import numpy as np
import tensorflow as tf
from mpi4py import MPI

from mpi_strategy.failure import aborting as job_is_aborting
from mpi_strategy import rendezvous as rendezvous_lib
from mpi_strategy.errors import MPIStrategyError, RanksLostError

# What this rank does inside the write point it is in (None: in none).
WRITES, WRITES_ALONE, IN_MEMORY = "writes", "writes alone", "in memory"
_ERROR_CHARS = 2000
# How a disagreement names a rank at the end of a save (rendezvous.describe):
# a rank that fails before a collective of the save meets the others there.
_END_OF_SAVE = rendezvous_lib.describe(
    rendezvous_lib.signature(0, rendezvous_lib.WRITE_DONE, np.uint8, []))

_local = threading.local()
# The OrderedComm of the newest strategy over all ranks. Kept alive: whether a
# rank meets the others must never depend on what its program still holds.
_current = {"comm": None}
_counter = itertools.count(1)  # next() is atomic under the GIL


def role():
    """What this rank does in the write point it is in: WRITES, WRITES_ALONE,
    IN_MEMORY, or None outside one."""
    return getattr(_local, "role", None)


def alone():
    """True inside a write point that only some ranks entered."""
    return getattr(_local, "alone", False)


def register(ordered_comm, survivors=False):
    """Makes ``ordered_comm`` (of a new strategy) the one that write points made
    outside any strategy's scope meet on, and that the program's end is agreed
    on, if it spans all of ``COMM_WORLD`` (a strategy on a sub-communicator
    cannot speak for the ranks outside it) or all its living ranks
    (``survivors``: after ranks died, see ``elastic.py``)."""
    if survivors or (ordered_comm.size > 1 and _spans_the_world(ordered_comm.comm)):
        _current["comm"] = ordered_comm
        _register_finalize_once()


def _spans_the_world(comm):
    mine, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return mine.Compare(world) == MPI.IDENT
    finally:
        mine.Free()
        world.Free()


def _ordered_comm():
    """Where the ranks meet for a save: the strategy in scope, else the newest
    strategy over all ranks; None if that is one rank (nothing to meet)."""
    strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    in_scope = getattr(getattr(strategy, "extended", None), "_cross_device_ops", None)
    ordered = getattr(in_scope, "ordered_comm", None)
    if ordered is None:
        ordered = _current["comm"]
    if ordered is None or ordered.size == 1 or not ordered.rendezvous.usable:
        return None
    return ordered


def applies(path):
    """True if a call writing ``path`` here must be a write point."""
    return (role() is None and isinstance(path, (str, os.PathLike))
            and not os.fspath(path).startswith("ram://")
            and tf.executing_eagerly() and _ordered_comm() is not None)


@contextlib.contextmanager
def write_point(path, what):
    """The block writes ``path`` if ``role()`` is WRITES or WRITES_ALONE inside it.

    ``what`` names the call (e.g. "tf.train.Checkpoint.write"); the ranks that
    make it meet. If they name different paths (programs written for other
    strategies send non-chief writes to temporary paths), each path is written
    by the lowest rank naming it. With role IN_MEMORY the block must make the
    same call without writing to disk (``saving.py``).
    """
    ordered = _ordered_comm()
    path = os.fspath(path)
    rendezvous = ordered.rendezvous
    everyone = rendezvous.agree(rendezvous_lib.WRITE, np.uint8, [], tag=what,
                                nbytes=zlib.crc32(path.encode()))
    if everyone is None:
        # Made on some ranks only: they write, as the program asked; if several
        # made this very call, the lowest of them writes (they would race).
        solo_role = WRITES_ALONE if rendezvous.alone_with[0] == ordered.rank else IN_MEMORY
        with _in_role(solo_role, rendezvous, alone=True):
            yield
        return
    paths = everyone[:, -1]
    if np.all(paths == paths[0]):
        writes = _writer_rank(ordered, path) == ordered.rank
    else:  # each rank named its own path (e.g. per-worker temporary directories)
        writes = int(np.flatnonzero(paths == paths[ordered.rank])[0]) == ordered.rank
    try:
        with _in_role(WRITES if writes else IN_MEMORY, rendezvous):
            yield
    except BaseException as exc:
        # Every rank meets again, except one whose error came from meeting
        # there a rank that failed earlier in the save.
        if _END_OF_SAVE not in str(exc):
            _meet_after(ordered, what, path, f"{type(exc).__name__}: {exc}")
        raise
    _meet_after(ordered, what, path, "")


@contextlib.contextmanager
def _in_role(current, rendezvous, alone=False):
    _local.role, _local.alone = current, alone
    rendezvous.saving_alone = alone
    try:
        yield
    finally:
        _local.role, _local.alone = None, False
        rendezvous.saving_alone = False


def memory_path(path):
    """A fresh in-memory path (TensorFlow's ``ram://``) named like ``path``."""
    name = os.path.basename(os.path.normpath(path)) or "saved"
    return f"ram://mpi_strategy/{os.getpid()}/{next(_counter)}/{name}"


def remove_memory_path(path):
    """Frees what was written under ``memory_path``'s result ``path``."""
    root = path.rsplit("/", 1)[0]
    try:
        if tf.io.gfile.exists(root):
            tf.io.gfile.rmtree(root)
    except tf.errors.OpError:
        pass  # memory only: nothing on disk is left behind


def _meet_after(ordered, what, path, failure):
    """Every rank waits for every other; a failure anywhere raises everywhere."""
    failure = failure[:_ERROR_CHARS]
    everyone = ordered.rendezvous.agree(rendezvous_lib.WRITE_DONE, np.uint8, [],
                                        nbytes=len(failure))
    if not everyone[:, -1].any():
        return
    texts = _allgather_text(ordered.comm, failure)
    if failure:
        return  # this rank re-raises its own exception
    failed = [f"rank {r}: {text}" for r, text in enumerate(texts) if text]
    raise MPIStrategyError(
        f"mpi_strategy: {what}({path!r}) failed on another rank, so it is not "
        f"complete: {'; '.join(failed)}")


# -- one writer per filesystem ------------------------------------------------
_PROBE_SECONDS = 1.0  # how long a rank looks for another's probe file (NFS caches lookups)


def _writer_rank(ordered, path):
    """The rank that writes ``path`` for this rank's filesystem (collective).

    Rank 0 on a filesystem every rank sees (and for remote URLs); on node-local
    disks, the lowest rank of each node that sees the same directory. Ranks of
    one node are taken to share their filesystems.
    """
    if "://" in path:
        return 0
    leader_of = _node_leaders(ordered)
    if len(set(leader_of)) == 1:
        return 0
    directory = os.path.dirname(os.path.normpath(path)) or "."
    cache = ordered.__dict__.setdefault("_writers", {})
    if directory not in cache:
        cache[directory] = _probe(ordered.comm, directory, leader_of)
    return cache[directory]


def _node_leaders(ordered):
    """For every rank, the lowest rank of its node (MPI's shared-memory domain)."""
    if not hasattr(ordered, "_leader_of"):
        node = ordered.comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            leader = np.array([ordered.rank], np.int64)
            node.Bcast(leader, root=0)
        finally:
            node.Free()
        everyone = np.empty(ordered.size, np.int64)
        ordered.comm.Allgather(leader, everyone)
        ordered._leader_of = everyone.tolist()
    return ordered._leader_of


def _probe(comm, directory, leader_of):
    """The writer for this rank's copy of ``directory``: the lowest rank of the
    nodes that see the same files there (each node's leader creates a probe
    file; two nodes share a filesystem if either sees the other's)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    token = np.frombuffer(os.urandom(8), np.uint8).copy()
    comm.Bcast(token, root=0)
    mine = ""
    if leader_of[rank] == rank:
        try:
            existing = _nearest_existing(os.path.abspath(directory))
            mine = os.path.join(existing, f".mpi_strategy-probe-{token.tobytes().hex()}-{rank}")
            open(mine, "w").close()
        except (OSError, ValueError):
            mine = ""  # not writable here: the save itself will say so, on every rank
    probes = _allgather_text(comm, mine)
    seen = np.zeros(size, np.int8)
    seen[leader_of[rank]] = 1
    seen[_visible({r: p for r, p in enumerate(probes) if p and r != leader_of[rank]})] = 1
    everyone = np.empty((size, size), np.int8)
    comm.Allgather(seen, everyone)
    comm.Barrier()
    if mine:
        try:
            os.remove(mine)
        except OSError:
            pass
    return min(_same_filesystem(everyone, leader_of, rank))


def _same_filesystem(seen, leader_of, rank):
    """The ranks connected to ``rank`` by "saw the probe of the other's node"."""
    linked = (seen | seen.T).astype(bool)
    group, todo = {rank}, [rank]
    while todo:
        r = todo.pop()
        for other in np.flatnonzero(linked[r] | linked[:, leader_of[r]]).tolist() + [leader_of[r]]:
            if other not in group:
                group.add(other)
                todo.append(other)
    return group


def _allgather_text(comm, text):
    data = np.frombuffer(os.fsencode(text), np.uint8)
    counts = np.empty(comm.Get_size(), np.int64)
    comm.Allgather(np.array([data.size], np.int64), counts)
    received = np.empty(int(counts.sum()), np.uint8)
    comm.Allgatherv(data, [received, (counts.tolist(), None), MPI.BYTE])
    offsets = np.concatenate([[0], np.cumsum(counts)])
    return [os.fsdecode(bytes(received[offsets[r]:offsets[r + 1]])) for r in range(len(counts))]


def _nearest_existing(directory):
    while not os.path.isdir(directory):
        directory = os.path.dirname(directory)
    return directory


def _visible(probes):
    """The ranks (keys) whose probe file (value) this rank can open, waiting up
    to _PROBE_SECONDS for all of them (NFS may cache a file's absence)."""
    deadline = time.monotonic() + _PROBE_SECONDS
    seen = []
    while True:
        for directory in {os.path.dirname(p) for p in probes.values()}:
            try:
                os.listdir(directory)  # makes NFS look again
            except OSError:
                pass
        for r, probe in list(probes.items()):
            if os.path.exists(probe) and _opens(probe):
                seen.append(r)
                del probes[r]
        if not probes or time.monotonic() >= deadline:
            return seen
        time.sleep(0.05)


def _opens(path):
    try:
        with open(path):
            return True
    except OSError:
        return False


# -- the end of the program -----------------------------------------------------
_finalize_registered = [False]


def _register_finalize_once():
    if not _finalize_registered[0]:
        _finalize_registered[0] = True
        atexit.register(agree_on_the_end)


def agree_on_the_end():
    """Ranks meet once more before MPI ends: a rank saving alone (under
    ``if rank == 0``) finishes its save, and a rank still waiting in a
    collective that the others left gets an error instead of a hang. Once."""
    ordered = _current["comm"]
    _current["comm"] = None
    if (ordered is None or not ordered.rendezvous.usable or ordered.failed
            or MPI.Is_finalized() or job_is_aborting()):
        return
    try:
        ordered.rendezvous.agree(rendezvous_lib.FINALIZE, np.uint8, [])
    except RanksLostError:
        return  # a rank died at the very end (ULFM): elastic.py ends without it
    except MPIStrategyError as exc:
        sys.stderr.write(f"{exc}\n")
        sys.stderr.flush()
        time.sleep(1.0)  # lets the launcher forward the message before the abort kills all
        MPI.COMM_WORLD.Abort(1)
