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

Above ``protocol.HASHED_ABOVE`` (1024) ranks, gathering every record would
cost O(ranks) bytes per rank per collective; there the ranks compare a 63-bit
hash of what must agree instead (one Allreduce of 24 bytes: the largest hash,
minus the smallest, and the largest preemption notice), gather the records
only when the hashes differ (to explain the disagreement, or to settle a save
that some ranks are in), carry no data, and an all-gather learns each rank's
byte count in one more small Allgather.

With ``CommunicationOptions(timeout_seconds=T)`` the Allgather is polled and
a rank that waited ``T`` seconds names the ranks that never arrived
(``timeouts.py``).

Every record also carries the rank's preemption notice (``notice``: a signal
number, set when a batch scheduler warns the rank), so that every rank learns
it from the same collective (``noticed``) without an MPI call of its own.
The wire format is ``protocol.py``'s; the kinds of collective and the words
of the errors are ``kinds.py``'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from mpi_strategy._src.core import protocol, timeouts
from mpi_strategy._src.core.errors import MPIStrategyError
from mpi_strategy._src.core.kinds import (
    CONSTANT_ADVICE,
    ORDER_ADVICE,
    Kind,
    describe,
    kind_of,
    shapes_text,
)
from mpi_strategy._src.core.process import PROCESS
from mpi_strategy._src.core.protocol import (
    MUST_AGREE,
    SIGNATURE_BYTES,
    Field,
    Shape,
    State,
    as_int64,
    hash_of,
    record_bytes,
    signature,
)

ErrorClass = Callable[[str], Exception]


def post_notice(signum: int) -> None:
    """This rank received a preemption notice (signal ``signum``): every
    later agreement of every communicator carries it to the other ranks, who
    learn it from the same collective (``Agreement.noticed``). The first
    notice stays. Safe in a signal handler (it sets integers)."""
    if not PROCESS.notice:
        PROCESS.notice = signum
        for agreement in list(PROCESS.agreements):
            agreement.notice = signum


class Agreement:
    """Signature agreement (and, optionally, a timeout) for one communicator.

    Its exchanges are MPI calls on the communicator it is given: that one must
    carry nothing else (``ArrayCollectives`` gives it a duplicate of its own)."""

    def __init__(
        self,
        comm: MPI.Intracomm,
        name_missing_ranks: bool = False,
        mismatch_error: ErrorClass = MPIStrategyError,
        timeout_error: ErrorClass = MPIStrategyError,
    ) -> None:
        """``name_missing_ranks``: announce every collective to the other ranks
        on a duplicate of ``comm`` (created here, so collectively), so that a
        timeout can say which ranks never arrived. ``mismatch_error`` and
        ``timeout_error``: the exception classes raised (with the message) when
        the ranks disagree and when a timeout expires (the binding gives ones
        that are also ``tf.errors`` classes)."""
        self._comm = comm
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        # The collective number, the previous ordering token and the partial
        # meeting this rank is in live in ``state``, which compiled kernels
        # share (``State``), followed in one block by the announcements.
        self._announcements = timeouts.Announcements(comm, name_missing_ranks)
        self.block = np.zeros(len(State) + self._announcements.words, np.int64)
        self.state = self.block[: len(State)]
        self._announcements.use(self.block[len(State) :])
        self.state[State.NOTICE] = PROCESS.notice
        PROCESS.agreements.add(self)
        self.state[State.RECORD_BYTES] = record_bytes(self._size)
        self.state[State.CARRY_BYTES] = self.carry_bytes
        self.state[State.RANK], self.state[State.SIZE] = self._rank, self._size
        self.state[State.AGREE_COMM] = as_int64(comm.handle)
        self.hashed = self._size > protocol.HASHED_ABOVE
        self.state[State.HASHED] = int(self.hashed)
        self._hash_agreed = False  # the last exchange agreed by hash (no records gathered)
        self.state[State.ANNOUNCE_COMM] = self._announcements.handle
        self._mismatch_error, self._timeout_error = mismatch_error, timeout_error
        self.solo_with: list[int] = []  # after a partial meeting: the ranks in the same one
        self.usable = True  # False once a timeout left a request pending
        self.disagreed: list[Kind] = []  # the kinds the ranks were in at the last mismatch
        self._received = np.empty((0, 0), np.uint8)  # every rank's record of the last exchange
        self.agreed_at = 0.0  # time.perf_counter() when the last agreement completed

    def communicators(self) -> list[MPI.Intracomm]:
        """The communicators this agreement calls MPI on: the one it was given,
        then the announcements' (when on)."""
        return [self._comm, *self._announcements.communicators()]

    def move_to(self, block: np.ndarray) -> None:
        """Keeps the shared state in ``block`` (int64, the size of ``block``)
        from now on: the native engine's memory, which its kernels find."""
        block[:] = self.block
        self.block, self.state = block, block[: len(State)]
        self._announcements.use(block[len(State) :])

    @property
    def seq(self) -> int:
        """The number of the last collective of this communicator (1, 2, ...)."""
        return self._seq

    @property
    def _seq(self) -> int:
        return int(self.state[State.SEQ])

    @_seq.setter
    def _seq(self, value: int) -> None:
        self.state[State.SEQ] = value

    @property
    def solo(self) -> Kind | None:
        """The partial meeting this rank is in without the others (None: none)."""
        code = int(self.state[State.SOLO])
        return kind_of(code) if code else None

    @solo.setter
    def solo(self, kind: Kind | None) -> None:
        self.state[State.SOLO] = kind.code if kind else 0

    @property
    def carry_bytes(self) -> int:
        """The most data bytes a rank's record carries (see ``agree_carrying``)."""
        return record_bytes(self._size) - SIGNATURE_BYTES

    def agree_carrying(
        self,
        data: np.ndarray,
        kind: Kind,
        dtype: Any,
        shapes: Sequence[Shape],
        rows: int = 0,
        timeout: float | None = None,
        token: int | None = None,
        tag: str = "",
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """``agree``, with this rank's ``data`` (a 1-D uint8 array) in the same message.

        Returns ``(everyone, carried)``: ``everyone`` as from ``agree`` (its
        ``Field.BYTES`` column is each rank's number of data bytes), and ``carried`` one
        row per rank whose first bytes are that rank's ``data``, identical on
        every rank - or None when some rank's data did not fit in
        ``carry_bytes``; then the caller moves the data with its own MPI call.
        """
        fits = data.size <= self.carry_bytes and not self.hashed
        everyone = self.agree(
            kind,
            dtype,
            shapes,
            rows=rows,
            nbytes=data.size,
            timeout=timeout,
            tag=tag,
            token=token,
            _data=data if fits else None,
        )
        assert everyone is not None  # (a data collective is never partial)
        if self.hashed:
            if kind.own_bytes:  # (agreed by hash: no record says the byte counts)
                counts = np.empty(self._size, np.int64)
                mine = np.array([data.size], np.int64)
                self._comm.Allgather([mine, MPI.INT64_T], [counts, MPI.INT64_T])
                everyone = everyone.copy()
                everyone[:, Field.BYTES] = counts
            return everyone, None
        if everyone[:, Field.BYTES].max() > self.carry_bytes:
            return everyone, None
        return everyone, self._received[:, SIGNATURE_BYTES:]

    def agree(
        self,
        kind: Kind,
        dtype: Any,
        shapes: Sequence[Shape],
        rows: int = 0,
        nbytes: int = 0,
        timeout: float | None = None,
        tag: str = "",
        token: int | None = None,
        _data: np.ndarray | None = None,
    ) -> np.ndarray | None:
        """Blocks until every rank has entered this collective; raises if they differ.

        ``shapes`` must be equal on all ranks (see ``signature``); ``timeout``
        is in seconds (None: wait as long as MPI does, forever); ``token``: the
        collective's ordering token (``OrderedComm``; None for a meeting): how
        far it moved since the previous collective must agree.

        Returns every rank's signature, one row per rank, identical on every
        rank (the ``Field.BYTES`` column is each rank's ``nbytes``, what it sends in an
        all_gather).

        A ``partial`` kind (a save) that not every rank entered is not an
        error: it returns None on the ranks that entered it (they go on alone,
        as the program asked; ``solo_with`` says with whom), and the other ranks
        meet again, in the collective they were entering, once those ranks are
        done.
        """
        self._seq += 1
        self.disagreed = []
        token_step = 0
        if token is not None:
            token_step = token - int(self.state[State.TOKEN])
            self.state[State.TOKEN] = token
        solo = self.solo.code if self.solo else 0
        mine = signature(
            self._seq, kind.code, dtype, shapes, rows, nbytes, tag, solo, token_step, self.notice
        )
        everyone = self._exchange(mine, _data, shapes, timeout)
        agreed = (
            everyone
            if self._hash_agreed
            else self._settle(
                everyone, kind, shapes, lambda: self._exchange(mine, _data, shapes, timeout)
            )
        )
        if agreed is not None:
            self.agreed_at = time.perf_counter()
        return agreed

    def _settle(
        self,
        everyone: np.ndarray,
        kind: Kind,
        shapes: Sequence[Shape],
        exchange: Callable[[], np.ndarray],
    ) -> np.ndarray | None:
        """``agree`` after the first exchange: meets again while some ranks
        are in a partial meeting the others are not, then raises if the ranks
        disagree."""
        while True:
            partial = [kind_of(code).partial for code in everyone[:, Field.KIND].tolist()]
            differ = np.any(everyone[:, MUST_AGREE] != everyone[0, MUST_AGREE])
            if not (differ and any(partial)):
                break
            if kind.partial:
                self._seq -= 1  # the next collective takes this number
                described = slice(Field.KIND, Field.NOTICE)  # (a notice may differ)
                same = np.all(everyone[:, described] == everyone[self._rank, described], axis=1)
                self.solo_with = np.flatnonzero(same).tolist()
                return None
            everyone = exchange()
        if differ:
            self._raise_disagreement(everyone, shapes)
        return everyone

    def settle_compiled(self, received: np.ndarray, shapes: Sequence[Shape]) -> None:
        """What a compiled kernel (``native/``) calls when the records it
        gathered (``received``: one row per rank, updated in place) disagree:
        ``agree``'s settling, meeting again with this rank's same record. Raises
        as ``agree`` does."""
        record = received[self._rank].copy()
        self.disagreed = []
        kind = kind_of(int(record[:SIGNATURE_BYTES].view(np.int64)[Field.KIND]))
        self._settle(
            received[:, :SIGNATURE_BYTES].copy().view(np.int64),
            kind,
            shapes,
            lambda: self._meet(record, received, shapes, None),
        )

    def _exchange(
        self,
        mine: np.ndarray,
        data: np.ndarray | None,
        shapes: Sequence[Shape],
        timeout: float | None,
    ) -> np.ndarray:
        """Every rank's signature (one row per rank), from this rank's
        signature ``mine`` and ``data`` (see ``_meet``)."""
        record = np.zeros(record_bytes(self._size), np.uint8)
        record[: mine.nbytes] = mine.view(np.uint8)
        if data is not None:
            record[mine.nbytes : mine.nbytes + data.size] = data
        return self._meet(record, None, shapes, timeout)

    def _meet(
        self,
        record: np.ndarray,
        into: np.ndarray | None,
        shapes: Sequence[Shape],
        timeout: float | None,
    ) -> np.ndarray:
        """Every rank's signature (one row per rank); every rank's ``record``
        lands in ``into`` (default: a new ``_received``). Hashed: when the
        hashes agree (``_hash_agreed``), this rank's signature in every row
        and no record gathered."""
        mine = record[:SIGNATURE_BYTES].view(np.int64)
        self._hash_agreed = self.hashed and self._hashes_agree(mine, shapes, timeout)
        if self._hash_agreed:
            return np.broadcast_to(mine, (self._size, mine.size))
        if into is None:
            into = self._received = np.empty((self._size, record.size), np.uint8)
        # Always the non-blocking Allgather: MPI never matches a blocking
        # collective with a non-blocking one, and a save's meeting (no
        # timeout) may meet a collective that has one.
        self._complete(lambda: self._comm.Iallgather(record, into), mine, shapes, timeout)
        everyone = into[:, :SIGNATURE_BYTES].copy().view(np.int64)
        self._heard(int(everyone[:, Field.NOTICE].max()))
        return everyone

    def _hashes_agree(
        self, mine: np.ndarray, shapes: Sequence[Shape], timeout: float | None
    ) -> bool:
        """Whether every rank's signature hashes alike: one Allreduce (max)
        of (hash, -hash, notice) gives the largest and the smallest hash, and
        the notice if any rank sent one."""
        extremes = np.array([hash_of(mine), -hash_of(mine), mine[Field.NOTICE]], np.int64)
        self._complete(
            lambda: self._comm.Iallreduce(MPI.IN_PLACE, [extremes, MPI.INT64_T], op=MPI.MAX),
            mine,
            shapes,
            timeout,
        )
        self._heard(int(extremes[2]))
        return bool(extremes[0] == -extremes[1])

    # -- preemption notice ---------------------------------------------------
    def _heard(self, notice: int) -> None:
        """Every rank learns a notice from the same exchange: keep the first."""
        if notice and not self.state[State.NOTICED]:
            self.state[State.NOTICED] = notice
            self.state[State.NOTICED_AT] = self._seq

    @property
    def notice(self) -> int:
        """This rank's preemption notice, which every later record carries
        (0: none; ``post_notice`` sets it)."""
        return int(self.state[State.NOTICE])

    @notice.setter
    def notice(self, signum: int) -> None:
        if not self.state[State.NOTICE]:
            self.state[State.NOTICE] = signum

    @property
    def noticed(self) -> tuple[int, int] | None:
        """``(signal number, collective number)``: the first notice any rank
        sent, and the collective whose agreement carried it to every rank;
        the same on every rank once that collective is done (None before).
        Alone (one rank, whose collectives meet no one), its own notice."""
        if self._size == 1 and self.notice:
            return self.notice, self._seq
        if not self.state[State.NOTICED]:
            return None
        return int(self.state[State.NOTICED]), int(self.state[State.NOTICED_AT])

    def _complete(
        self,
        start: Callable[[], MPI.Request],
        mine: np.ndarray,
        shapes: Sequence[Shape],
        timeout: float | None,
    ) -> None:
        """Starts a non-blocking exchange and waits for it; with a timeout,
        announced to the other ranks first, then polled (``_wait``)."""
        if timeout is None:
            start().Wait()
            return
        self._announcements.announce(self._seq)
        request = start()
        timeouts.wait(request, timeout, lambda: self.timed_out(mine, shapes, timeout))
        self._announcements.collect()

    # -- disagreement --------------------------------------------------------
    def _raise_disagreement(self, everyone: np.ndarray, shapes: Sequence[Shape]) -> None:
        by_rank = "; ".join(f"rank {r}: {describe(s)}" for r, s in enumerate(everyone))
        sizes = slice(Field.KIND, Field.TENSORS + 1)
        if np.all(everyone[:, sizes] == everyone[0, sizes]):
            by_rank += (
                " (same sizes, but the shapes or the parameters, such as a root rank, "
                "differ between ranks)"
            )
        kinds = [kind_of(code) for code in dict.fromkeys(everyone[:, Field.KIND].tolist())]
        self.disagreed = kinds
        blamed = [k.blame for k in kinds if k.blame]
        solo = [kind_of(code) for code in everyone[:, Field.SOLO].tolist() if code]
        if np.all(everyone[:, Field.KIND : Field.TOKEN] == everyone[0, Field.KIND : Field.TOKEN]):
            advice = CONSTANT_ADVICE  # only the tokens differ
            by_rank = "; ".join(
                f"rank {r}: {describe(s)} (ordering token moved by "
                f"{s[Field.TOKEN]} since the previous collective)"
                for r, s in enumerate(everyone)
            )
        elif blamed:
            advice = blamed[0]
        elif solo:
            advice = solo[0].solo_advice
        elif len(kinds) == 1 and kinds[0].advice:
            advice = kinds[0].advice
        else:
            advice = ORDER_ADVICE
        raise self._mismatch_error(
            f"mpi_strategy: ranks disagree in an MPI collective (collective "
            f"#{everyone[self._rank, Field.SEQ]} of this communicator; this is rank {self._rank}, "
            f"shapes {shapes_text(shapes)}). {by_rank}. {advice}"
        )

    # -- timeout ---------------------------------------------------------------
    def timed_out(self, mine: np.ndarray, shapes: Sequence[Shape], timeout: float) -> Exception:
        """The error of a timeout in collective ``mine`` (this rank's
        signature), also a native kernel's; the communicator is unusable from
        then on (a request is left pending)."""
        self.usable = False
        return self._timeout_error(
            f"mpi_strategy: timeout after {timeout:g} s on rank {self._rank} in "
            f"{describe(mine)} (shapes {shapes_text(shapes)}; "
            f"collective #{self._seq} of this communicator): "
            f"{self._announcements.missing(self._seq)}. "
            f"{ORDER_ADVICE} "
            "The communicator cannot be used after this error; end the job and "
            "resume from the last checkpoint."
        )
