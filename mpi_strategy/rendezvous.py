"""Before each collective, the ranks agree on what it is, and notice who is missing.

Every MPI collective of ``OrderedComm`` starts with one small Allgather of a
fixed-size *signature* (which collective, dtype, element count) from every
rank. A rank that issues another collective, or the same one with another
dtype or shape, meets the others in that Allgather - always the same number of
bytes, so MPI never truncates a message or mixes up buffers - and every rank
raises the same error, naming what each rank was doing. The check is always
on: it costs one 64-byte Allgather per collective.

With ``CommunicationOptions(timeout_seconds=T)`` the Allgather is non-blocking
and polled, and each rank tells the others (a few bytes, point to point) the
number of every collective it enters. A rank that waited ``T`` seconds then
raises an error naming the collective, its shape and the ranks that never
arrived, with the last collective each of them entered.
"""

import time
import zlib

import numpy as np
from mpi4py import MPI

from mpi_strategy.errors import MPIStrategyError

ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL = 1, 2, 3, 4
_KIND_NAMES = {ALLREDUCE: "allreduce", ALLGATHER: "all_gather", BROADCAST: "broadcast",
               ALLTOALL: "alltoall"}

_DTYPES = [np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64, np.float16,
                                 np.bool_, np.uint8, np.int8, np.int16, np.uint16,
                                 np.uint32, np.uint64, np.complex64, np.complex128)]
_DTYPE_CODES = {d: i for i, d in enumerate(_DTYPES)}

# Signature fields: collective number; kind, dtype, elements (per row for
# all_gather), number of tensors, a hash of their shapes and dtypes (these
# must agree); rows and bytes sent (all_gather only, may differ between ranks).
_SEQ, _KIND, _DTYPE, _COUNT, _TENSORS, _LAYOUT, _ROWS, _BYTES = range(8)
_MUST_AGREE = slice(_KIND, _LAYOUT + 1)

_ANNOUNCE_TAG = 7


def _dtype_code(dtype):
    dtype = np.dtype(dtype)
    return _DTYPE_CODES.get(dtype, 1000 + dtype.num)


def _dtype_name(code):
    return _DTYPES[code].name if code < len(_DTYPES) else f"dtype#{code - 1000}"


def signature(seq, kind, dtype, shapes, rows=0, nbytes=0):
    """The fixed-size description of a collective that every rank compares.

    ``shapes``: the shapes that must agree (of each tensor packed into an
    allreduce; of a broadcast tensor; of a row of each all_gathered tensor).
    ``dtype``: one dtype, or one per shape (all_gather of several tensors).
    """
    shapes = [tuple(int(d) for d in shape) for shape in shapes]
    dtypes = list(dtype) if isinstance(dtype, (list, tuple)) else [dtype]
    codes = [_dtype_code(d) for d in dtypes]
    count = sum(int(np.prod(shape, dtype=np.int64)) for shape in shapes)
    layout = zlib.crc32(repr((shapes, codes)).encode()) & 0x7FFFFFFF
    return np.array([seq, kind, codes[0], count, len(shapes), layout, rows, nbytes], np.int64)


def describe(signature):
    """What a signature means, in words (e.g. "allreduce of 10 float32 elements")."""
    kind, dtype = _KIND_NAMES.get(int(signature[_KIND]), "?"), _dtype_name(int(signature[_DTYPE]))
    if signature[_KIND] == ALLGATHER:
        if signature[_TENSORS] != 1:
            return (f"all_gather of {signature[_TENSORS]} tensors ({signature[_ROWS]} rows, "
                    f"{signature[_COUNT]} elements per row in all)")
        return (f"all_gather of {signature[_ROWS]} rows of {signature[_COUNT]} "
                f"{dtype} elements")
    packed = f" in {signature[_TENSORS]} tensors" if signature[_TENSORS] != 1 else ""
    return f"{kind} of {signature[_COUNT]} {dtype} elements{packed}"


_ADVICE = {
    ALLREDUCE: ("Element-wise reductions need tensors of one shape and dtype on every rank; "
                "per-replica batches of different sizes can only be reduced along an axis "
                "(strategy.reduce(..., axis=0)) or gathered."),
    ALLGATHER: ("Every rank must gather the same tensors, each of one dtype and with "
                "shapes that agree except along the gather axis."),
    BROADCAST: ("All ranks must create the same variables, in the same order, with the "
                "same shapes and dtypes (build the model identically on every rank)."),
    ALLTOALL: ("A compressed reduction (compression=...) needs the same tensors on every "
               "rank; the ranks are reducing different gradients (build the model "
               "identically on every rank) or use different compression settings."),
}
_ORDER_ADVICE = (
    "The ranks are running different collectives: every rank must run the same steps, "
    "in the same order. Common causes: reading a metric or calling strategy.reduce / "
    "gather on some ranks only (e.g. under `if rank == 0`), or ranks that build "
    "different models or take different branches in Python.")


class Rendezvous:
    """Signature agreement (and, optionally, a timeout) for one communicator."""

    def __init__(self, comm, name_missing_ranks=False):
        """``name_missing_ranks``: announce every collective to the other ranks
        on a duplicate of ``comm`` (created here, so collectively), so that a
        timeout can say which ranks never arrived."""
        self._comm = comm
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        self._seq = 0
        self._announce_comm = comm.Dup() if name_missing_ranks and self._size > 1 else None
        self._last_seen = np.zeros(self._size, np.int64)  # last collective each rank entered
        self._sends = []

    def agree(self, kind, dtype, shapes, rows=0, nbytes=0, timeout=None):
        """Blocks until every rank has entered this collective; raises if they differ.

        ``shapes`` must be equal on all ranks (see ``signature``); ``timeout``
        is in seconds (None: wait as long as MPI does, forever).

        Returns every rank's signature, one row per rank, identical on every
        rank (the last column is each rank's ``nbytes``, what it sends in an
        all_gather).
        """
        self._seq += 1
        mine = signature(self._seq, kind, dtype, shapes, rows, nbytes)
        everyone = np.empty((self._size, mine.size), np.int64)
        if timeout is None:
            self._comm.Allgather(mine, everyone)
        else:
            self._announce()
            self._wait(self._comm.Iallgather(mine, everyone), mine, shapes, timeout)
            self._collect_announcements()
        if np.any(everyone[:, _MUST_AGREE] != everyone[0, _MUST_AGREE]):
            self._raise_disagreement(everyone, shapes)
        return everyone

    # -- disagreement --------------------------------------------------------
    def _raise_disagreement(self, everyone, shapes):
        by_rank = "; ".join(f"rank {r}: {describe(s)}" for r, s in enumerate(everyone))
        if np.all(everyone[:, _KIND:_TENSORS + 1] == everyone[0, _KIND:_TENSORS + 1]):
            by_rank += " (same sizes, but the shapes differ between ranks)"
        kinds = set(everyone[:, _KIND].tolist())
        advice = _ADVICE[int(everyone[0, _KIND])] if len(kinds) == 1 else _ORDER_ADVICE
        raise MPIStrategyError(
            f"mpi_strategy: ranks disagree in an MPI collective (collective "
            f"#{everyone[self._rank, _SEQ]} of this communicator; this is rank {self._rank}, "
            f"shapes {_shapes_text(shapes)}). {by_rank}. {advice}")

    # -- timeout ---------------------------------------------------------------
    def _announce(self):
        if self._announce_comm is None:
            return
        MPI.Request.Waitall([req for req, _ in self._sends])  # small: long since delivered
        seq = np.array([self._seq], np.int64)
        self._sends = [(self._announce_comm.Isend(seq, dest=r, tag=_ANNOUNCE_TAG), seq)
                       for r in range(self._size) if r != self._rank]
        self._last_seen[self._rank] = self._seq

    def _collect_announcements(self):
        if self._announce_comm is None:
            return
        status, seq = MPI.Status(), np.empty(1, np.int64)
        while self._announce_comm.Iprobe(MPI.ANY_SOURCE, _ANNOUNCE_TAG, status):
            self._announce_comm.Recv(seq, source=status.Get_source(), tag=_ANNOUNCE_TAG)
            source = status.Get_source()
            self._last_seen[source] = max(self._last_seen[source], seq[0])

    def _missing(self):
        if self._announce_comm is None:
            return ("some ranks never reached it (which ones is known when the timeout is "
                    "set for the whole strategy: MPIStrategy(communication_options="
                    "tf.distribute.experimental.CommunicationOptions(timeout_seconds=T)))")
        self._collect_announcements()
        missing = [r for r in range(self._size) if self._last_seen[r] < self._seq]
        last = ", ".join(f"rank {r}: #{self._last_seen[r]}" for r in missing)
        return f"rank(s) {missing} never reached it (the last collective they entered: {last})"

    def _wait(self, request, mine, shapes, timeout):
        deadline = time.monotonic() + timeout
        pause = 0.0
        while not request.Test():
            if time.monotonic() > deadline:
                raise MPIStrategyError(
                    f"mpi_strategy: timeout after {timeout:g} s on rank {self._rank} in "
                    f"{describe(mine)} (shapes {_shapes_text(shapes)}; "
                    f"collective #{self._seq} of this communicator): {self._missing()}. "
                    f"{_ORDER_ADVICE} "
                    "The communicator cannot be used after this error; end the job and "
                    "resume from the last checkpoint.")
            # Poll often at first (most waits are short), then back off to
            # leave the cores to the ranks still computing.
            time.sleep(pause)
            pause = min(2 * pause + 1e-5, 1e-3)


def _shapes_text(shapes):
    text = ", ".join(str(tuple(int(d) for d in shape)) for shape in shapes[:4])
    return text + (f", ... ({len(shapes)} in all)" if len(shapes) > 4 else "")
