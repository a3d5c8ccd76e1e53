"""Before each collective, the ranks agree on what it is, and notice who is missing.

Every MPI collective of ``OrderedComm`` starts with one small Allgather of a
fixed-size *record* from every rank: the collective's *signature* (which
collective, dtype, element count), then room for a few hundred bytes of data.
A rank that issues another collective, or the same one with another dtype or
shape, meets the others in that Allgather - always the same number of bytes, so
MPI never truncates a message or mixes up buffers - and every rank raises the
same error, naming what each rank was doing. The check is always on.

A collective whose data fits in the record on every rank (a loss, a metric's
total and count, ``optimizer.iterations``) travels in that same Allgather: the
ranks check the signatures and then compute the result from the data they
already hold, so a small collective costs one MPI round, not two. A large one
costs the Allgather, then its own MPI call.

With ``CommunicationOptions(timeout_seconds=T)`` the Allgather is non-blocking
and polled, and each rank tells the others (a few bytes, point to point) the
number of every collective it enters. A rank that waited ``T`` seconds then
raises an error naming the collective, its shape and the ranks that never
arrived, with the last collective each of them entered.
"""

import functools
import math
import time
import weakref
import zlib

import numpy as np
from mpi4py import MPI

from mpi_strategy.errors import CollectiveMismatchError, CollectiveTimeoutError

ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL = 1, 2, 3, 4
# Not data collectives: the meetings of ``write_point.py`` (a save called on
# every rank; the end of that save) and of the end of the program.
WRITE, WRITE_DONE, FINALIZE = 5, 6, 7
_KIND_NAMES = {ALLREDUCE: "allreduce", ALLGATHER: "all_gather", BROADCAST: "broadcast",
               ALLTOALL: "alltoall", WRITE: "a save", WRITE_DONE: "the end of a save",
               FINALIZE: "the end of the program"}

_DTYPES = [np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64, np.float16,
                                 np.bool_, np.uint8, np.int8, np.int16, np.uint16,
                                 np.uint32, np.uint64, np.complex64, np.complex128)]
_DTYPE_CODES = {d: i for i, d in enumerate(_DTYPES)}

# Signature fields: collective number; kind, dtype, elements (per row for
# all_gather), number of tensors, a hash of their shapes and dtypes (and of a
# save's path), whether this rank is inside a save that only some ranks called,
# how far the communicator's ordering token moved since the previous
# collective (1, plus a hash of the constants that ranks assumed equal instead
# of sending them: ``OrderedComm.check_same_constants``) (these must agree); rows and bytes sent (all_gather only, may differ).
_SEQ, _KIND, _DTYPE, _COUNT, _TENSORS, _LAYOUT, _ALONE, _TOKEN, _ROWS, _BYTES = range(10)
_MUST_AGREE = slice(_KIND, _TOKEN + 1)
_SIGNATURE_BYTES = 8 * (_BYTES + 1)

_ANNOUNCE_TAG = 7


def record_bytes(size):
    """Bytes each rank sends in the agreement Allgather, on a communicator of ``size``.

    512 up to 32 ranks; less on larger communicators so that the Allgather
    stays about 16 KiB, but always room for a few scalars. The same on every rank.
    """
    return max(128, min(512, 16384 // max(size, 1) // 8 * 8))


def _dtype_code(dtype):
    dtype = np.dtype(dtype)
    return _DTYPE_CODES.get(dtype, 1000 + dtype.num)


def _dtype_name(code):
    return _DTYPES[code].name if code < len(_DTYPES) else f"dtype#{code - 1000}"


def signature(seq, kind, dtype, shapes, rows=0, nbytes=0, tag="", alone=False, token_step=0):
    """The fixed-size description of a collective that every rank compares.

    ``shapes``: the shapes that must agree (of each tensor packed into an
    allreduce; of a broadcast tensor; of a row of each all_gathered tensor).
    ``dtype``: one dtype, or one per shape (all_gather of several tensors).
    ``tag``: text that must agree too (which save, of which path).
    ``alone``: this rank is inside a save that the other ranks did not call.
    ``token_step``: how far the ordering token moved since the previous collective.
    """
    dtypes = tuple(dtype) if isinstance(dtype, (list, tuple)) else (dtype,)
    code, count, layout = _layout(tuple(tuple(shape) for shape in shapes), dtypes, tag)
    return np.array([seq, kind, code, count, len(shapes), layout, int(alone), token_step,
                     rows, nbytes], np.int64)


@functools.lru_cache(maxsize=4096)
def _layout(shapes, dtypes, tag):
    """(first dtype's code, elements, hash of shapes, dtypes and tag): the same few
    collectives recur every step, so each is worked out once."""
    shapes = [tuple(int(d) for d in shape) for shape in shapes]
    codes = [_dtype_code(d) for d in dtypes]
    count = sum(math.prod(shape) for shape in shapes)
    return codes[0], count, zlib.crc32(repr((shapes, codes, tag)).encode()) & 0x7FFFFFFF


def describe(signature):
    """What a signature means, in words (e.g. "allreduce of 10 float32 elements")."""
    kind, dtype = _KIND_NAMES.get(int(signature[_KIND]), "?"), _dtype_name(int(signature[_DTYPE]))
    if signature[_KIND] in (WRITE, WRITE_DONE, FINALIZE):
        return kind
    if signature[_ALONE]:
        kind = "(saving alone) " + kind
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
_SAVE_FAILED_ADVICE = (
    "A rank left a save before the others (at the end of a save): the save failed "
    "there (see that rank's own error), and its files are not complete.")
_CONSTANT_ADVICE = (
    "The ranks agree on this collective but assigned different constants before it "
    "(since the previous collective of this communicator) to a variable whose "
    "aggregation is ONLY_FIRST_REPLICA, such as optimizer.iterations. Such a constant "
    "is not sent (a one-process program has one value for it): compute it the same "
    "way on every rank, or assign a tensor (which rank 0 then sends to every rank).")
_ALONE_ADVICE = (
    "A rank is saving alone (the other ranks did not make the same save call) and "
    "the save reads a value that is summed over all ranks (a metric, or another "
    "sync-on-read variable), which needs every rank. Make the save call on every "
    "rank, as a one-process program does (mpi_strategy writes the files once), or "
    "save only objects without metrics.")


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
        if self._announce_comm is not None:  # freed with this object (not at exit)
            weakref.finalize(self, self._announce_comm.Free).atexit = False
        self._last_seen = np.zeros(self._size, np.int64)  # last collective each rank entered
        self._sends = []
        self.saving_alone = False  # set by write_point.py around a save only this rank made
        self.alone_with = []       # after a WRITE some ranks missed: the ranks in the same one
        self.usable = True         # False once a timeout left a request pending
        self._received = None      # every rank's record of the last exchange
        self._token = 0            # the ordering token of the previous collective
        self.agreed_at = 0.0       # time.perf_counter() when the last agreement completed

    @property
    def seq(self):
        """The number of the last collective of this communicator (1, 2, ...)."""
        return self._seq

    @property
    def carry_bytes(self):
        """The most data bytes a rank's record carries (see ``agree_carrying``)."""
        return record_bytes(self._size) - _SIGNATURE_BYTES

    def agree_carrying(self, data, kind, dtype, shapes, rows=0, timeout=None, token=None):
        """``agree``, with this rank's ``data`` (a 1-D uint8 array) in the same message.

        Returns ``(everyone, carried)``: ``everyone`` as from ``agree`` (its
        last column is each rank's number of data bytes), and ``carried`` one
        row per rank whose first bytes are that rank's ``data``, identical on
        every rank - or None when some rank's data did not fit in
        ``carry_bytes``; then the caller moves the data with its own MPI call.
        """
        fits = data.size <= self.carry_bytes
        everyone = self.agree(kind, dtype, shapes, rows=rows, nbytes=data.size,
                              timeout=timeout, token=token, _data=data if fits else None)
        if everyone is None or everyone[:, _BYTES].max() > self.carry_bytes:
            return everyone, None
        return everyone, self._received[:, _SIGNATURE_BYTES:]

    def agree(self, kind, dtype, shapes, rows=0, nbytes=0, timeout=None, tag="", token=None,
              _data=None):
        """Blocks until every rank has entered this collective; raises if they differ.

        ``shapes`` must be equal on all ranks (see ``signature``); ``timeout``
        is in seconds (None: wait as long as MPI does, forever); ``token``: the
        collective's ordering token (``OrderedComm``; None for a meeting): how
        far it moved since the previous collective must agree.

        Returns every rank's signature, one row per rank, identical on every
        rank (the last column is each rank's ``nbytes``, what it sends in an
        all_gather).

        A ``WRITE`` (a save) that not every rank entered is not an error: it
        returns None on the ranks that entered it (they save alone, as the
        program asked; ``alone_with`` says with whom), and the other ranks meet
        again, in the collective they were entering, once those ranks are done.
        """
        self._seq += 1
        token_step = 0
        if token is not None:
            token_step, self._token = token - self._token, token
        while True:
            everyone = self._exchange(
                signature(self._seq, kind, dtype, shapes, rows, nbytes, tag,
                          self.saving_alone, token_step), _data, shapes, timeout)
            writing = everyone[:, _KIND] == WRITE
            differ = np.any(everyone[:, _MUST_AGREE] != everyone[0, _MUST_AGREE])
            if not (differ and writing.any()):
                break
            if kind == WRITE:
                self._seq -= 1  # the next collective takes this number
                same = np.all(everyone[:, _KIND:] == everyone[self._rank, _KIND:], axis=1)
                self.alone_with = np.flatnonzero(same).tolist()
                return None
        if differ:
            self._raise_disagreement(everyone, shapes)
        self.agreed_at = time.perf_counter()
        return everyone

    def _exchange(self, mine, data, shapes, timeout):
        """Every rank's signature (one row per rank); their records stay in ``_received``."""
        record = np.zeros(record_bytes(self._size), np.uint8)
        record[:mine.nbytes] = mine.view(np.uint8)
        if data is not None:
            record[mine.nbytes:mine.nbytes + data.size] = data
        self._received = np.empty((self._size, record.size), np.uint8)
        # Always the non-blocking Allgather: MPI never matches a blocking
        # collective with a non-blocking one, and a save's meeting (no
        # timeout) may meet a collective that has one.
        if timeout is None:
            self._comm.Iallgather(record, self._received).Wait()
        else:
            self._announce()
            self._wait(self._comm.Iallgather(record, self._received), mine, shapes, timeout)
            self._collect_announcements()
        return self._received[:, :mine.nbytes].copy().view(np.int64)

    # -- disagreement --------------------------------------------------------
    def _raise_disagreement(self, everyone, shapes):
        by_rank = "; ".join(f"rank {r}: {describe(s)}" for r, s in enumerate(everyone))
        if np.all(everyone[:, _KIND:_TENSORS + 1] == everyone[0, _KIND:_TENSORS + 1]):
            by_rank += " (same sizes, but the shapes differ between ranks)"
        kinds = set(everyone[:, _KIND].tolist())
        if np.all(everyone[:, _KIND:_TOKEN] == everyone[0, _KIND:_TOKEN]):
            advice = _CONSTANT_ADVICE  # only the tokens differ
            by_rank = "; ".join(f"rank {r}: {describe(s)} (ordering token moved by "
                                f"{s[_TOKEN]} since the previous collective)"
                                for r, s in enumerate(everyone))
        elif WRITE_DONE in kinds:
            advice = _SAVE_FAILED_ADVICE
        elif everyone[:, _ALONE].any():
            advice = _ALONE_ADVICE
        elif len(kinds) == 1 and int(everyone[0, _KIND]) in _ADVICE:
            advice = _ADVICE[int(everyone[0, _KIND])]
        else:
            advice = _ORDER_ADVICE
        raise CollectiveMismatchError(
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
                self.usable = False
                raise CollectiveTimeoutError(
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
