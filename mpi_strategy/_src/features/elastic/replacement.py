"""Replacing lost ranks: new processes join the survivors at a commit.

With ``elastic.run(..., replace_lost=True)``, after a recovery that left fewer
ranks than the job had, the survivors start as many new processes of the same
program (``MPI_Comm_spawn``: same interpreter, command line, working directory
and environment) and go on training meanwhile. A replacement runs the program
from its start up to ``elastic.run`` (importing TensorFlow, building the
strategy and the model on its own), says that it is ready, and waits. At the
first commit after that, every survivor and every replacement meet: the world
grows back (the survivors keep their ranks, the replacements come after them),
rank 0 sends the commit just made (but a sharded optimizer's slots: the ranks
put them together after the join, ``recovery.grown``), and every rank calls
the function again.

``MPI_Comm_spawn`` returns only once the new processes initialised MPI (after
they imported TensorFlow), so it runs in a background thread, on its own
duplicate of the survivors' communicator. Open MPI 5.0 does not tell a spawned
process that a process of its parents' job died (measured: a receive from a
dead parent waits for ever), so a replacement waits only for messages that a
living survivor sends: JOIN, or LEAVE when ranks are lost again or the program
ends before it joined; and a join that does not complete ends it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI

from mpi_strategy._src.core import ulfm
from mpi_strategy._src.core.errors import MPIStrategyError
from mpi_strategy._src.core.logs import logger
from mpi_strategy._src.core.process import PROCESS
from mpi_strategy._src.core.wire import word as _word
from mpi_strategy._src.features.elastic import sharded
from mpi_strategy._src.features.elastic.state import Newest

_READY, _DECISION = 7301, 7302  # tags: replacements -> survivors' rank 0, and back
WAIT, JOIN, GIVE_UP = 1, 2, 4  # decide()'s answers (bits: agreed with ULFM's Agree)
_LEAVE, _HEARTBEAT, _SILENT = 8, 16, 32
HEARTBEAT_S = 5  # rank 0 tells waiting replacements that the survivors are there ...
SILENCE_S = 60  # ... and a replacement that hears nothing for this long leaves
START_LIMIT_S = 300  # a replacement that has neither joined nor left by then is ended
JOIN_TIMEOUT_S = 120  # a replacement told to join that is not joined by then ends (status 1)

# The command line and working directory this process was started with, to
# start it again; taken at import, before the program changes either.
_LAUNCH: dict[str, Any] = {
    "argv": list(getattr(sys, "orig_argv", [])),
    "cwd": os.getcwd(),
    "program": sys.argv[0] if sys.argv else "",
}

# Run by a replacement's interpreter: the survivors' environment (the launcher
# gives spawned processes its own) and working directory, then the survivors'
# command line in place of this one (so PYTHONPATH and the like count).
# The alarm (kept across exec) ends a replacement that never gets to join or
# leave, e.g. stuck in MPI_Init when a survivor died during the spawn.
_BOOT = """\
import json, os, signal, sys
for name, value in json.loads(sys.argv[1]).items():
    os.environ.setdefault(name, value)
os.chdir(sys.argv[2])
signal.alarm(int(sys.argv[4]))
os.execv(sys.executable, [sys.executable] + json.loads(sys.argv[3]))
"""


@dataclass
class PendingSends:
    """Requests of messages to replacements never waited for: alive until
    the process ends (``PROCESS.of``; see ``flush_sends``)."""

    requests: list[MPI.Request] = field(default_factory=list)


def _pending_sends() -> list[MPI.Request]:
    return PROCESS.of(PendingSends).requests


def check_can_replace() -> None:
    """Raises (on every rank: nothing here communicates) unless replacements can
    be started for this process."""
    if _LAUNCH["program"] in ("", "-", "-c") or len(_LAUNCH["argv"]) < 2:
        raise MPIStrategyError(
            "mpi_strategy.elastic.run(replace_lost=True) starts the program again for each "
            "lost rank: run it as `python train.py ...` or `python -m package.module ...` "
            f"(this process: {_LAUNCH['argv'] or sys.argv})."
        )
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        raise MPIStrategyError(
            "mpi_strategy.elastic.run(replace_lost=True) spawns replacements from a thread "
            "while training goes on: MPI must be initialized with MPI_THREAD_MULTIPLE "
            "(mpi4py's default)."
        )


class Spawning:
    """Replacements being started for the survivors of ``comm`` (collective).

    (Spawning from rank 0 alone and connecting the others at the join with
    ``MPI_Intercomm_create`` was tried: collectives on the result hung in Open
    MPI 5.0.)"""

    def __init__(self, comm: MPI.Intracomm, count: int) -> None:
        self.count = count
        self.started_at = time.time()
        self.spawned_at: float | None = None
        self._rank = comm.Get_rank()
        self._spawn_comm, self._decide_comm = comm.Dup(), comm.Dup()
        self._intercomm: MPI.Intercomm | None = None
        self._error: MPI.Exception | None = None
        self._settled = threading.Event()  # joined or dismissed: no more heartbeats
        self._thread = threading.Thread(target=self._spawn, daemon=True, name="mpi_strategy-spawn")
        self._thread.start()

    def _spawn(self) -> None:
        args: list[str] | None = None
        if self._rank == 0:
            args = [
                "-c",
                _BOOT,
                json.dumps(dict(os.environ)),
                _LAUNCH["cwd"],
                json.dumps(_LAUNCH["argv"][1:]),
                str(START_LIMIT_S),
            ]
        try:
            intercomm = self._spawn_comm.Spawn(
                sys.executable, args=args, maxprocs=self.count, root=0
            )
            intercomm.Set_errhandler(MPI.ERRORS_RETURN)
            self._intercomm = intercomm
        except MPI.Exception as error:
            self._error = error
        self.spawned_at = time.time()
        while self._rank == 0 and self._intercomm and not self._settled.wait(HEARTBEAT_S):
            _send(self._intercomm, _HEARTBEAT)

    def decide(self) -> int:
        """At a commit, on every survivor, the same answer: ``JOIN`` once every
        replacement is ready, ``GIVE_UP`` if they could not be started (or one
        died), else ``WAIT``. Raises ``MPI.Exception`` if a survivor died."""
        decision = ~0  # the others' bits leave rank 0's decision as it is ...
        if self._error is not None:
            decision = ~JOIN  # ... unless their spawn failed
        if self._rank == 0:
            decision = WAIT
            if self.spawned_at is not None:  # the thread goes on with heartbeats
                try:
                    if self._error is not None:
                        decision = GIVE_UP
                    else:
                        assert self._intercomm is not None  # (the spawn returned, no error)
                        if self._intercomm.Iprobe(source=0, tag=_READY):
                            decision = JOIN
                except MPI.Exception as error:  # a replacement died
                    self._error, decision = error, GIVE_UP
        decision = self._decide_comm.Agree(decision)
        if decision not in (WAIT, JOIN):
            decision = GIVE_UP
            self._thread.join()
            logger.warning(
                "mpi_strategy.elastic: could not start %d replacement(s) (%s); "
                "training goes on without them.",
                self.count,
                self._error.Get_error_string() if self._error else "see rank 0",
            )
        return decision

    def join(self, newest: Newest) -> MPI.Intracomm | None:
        """Every survivor: merges with the ready replacements and sends them
        ``newest`` (rank 0's commit); returns the merged communicator (survivors
        first), or None if a replacement built a state of other shapes. Raises
        ``MPI.Exception`` if a rank died (the intercommunicator is revoked then:
        every survivor in the join raises)."""
        self._settled.set()
        self._thread.join()  # the spawn returns on rank 0 first
        intercomm = self._intercomm
        assert intercomm is not None  # (decide() said JOIN: every spawn returned)
        try:
            root = MPI.ROOT if self._rank == 0 else MPI.PROC_NULL
            if self._rank == 0:
                intercomm.Recv(_word(), source=0, tag=_READY)
                intercomm.Send(_word(JOIN), dest=0, tag=_DECISION)
            _send_commit(intercomm, root, *newest)
            merged = intercomm.Merge(high=False)
            merged.Set_errhandler(MPI.ERRORS_RETURN)
            if not merged.Agree(1):  # every rank holds the state, of the same shapes
                logger.error(
                    "mpi_strategy.elastic: a replacement built a state of other "
                    "shapes than the survivors' (see its error); training goes on "
                    "without it."
                )
                return None
            return merged
        except MPI.Exception:
            if self._intercomm is not None:
                self._revoke(self._intercomm)
            raise

    def dismiss(self, wait_s: float = 0.0) -> bool:
        """The replacements will not join (ranks were lost again, or the program
        ends): every survivor whose spawn returned tells them to leave (the first
        message counts). False while the spawn has not returned here, within
        ``wait_s``: call again later. (After a survivor died during the spawn,
        Open MPI 5.0's spawn may never return on its root (measured); the
        replacements then hear no heartbeat and leave after ``SILENCE_S``, or
        are ended after ``START_LIMIT_S``.)"""
        self._settled.set()
        self._thread.join(wait_s)
        if self._thread.is_alive():
            return False
        self._revoke(self._decide_comm)
        if self._intercomm is not None:
            _send(self._intercomm, _LEAVE)
        return True

    @staticmethod
    def _revoke(comm: MPI.Comm) -> None:
        ulfm.revoke(comm)


def _send(intercomm: MPI.Intercomm, message: int) -> None:
    """To the replacements' rank 0; never waited for (see ``flush_sends``)."""
    try:
        _pending_sends().append(intercomm.Isend(_word(message), dest=0, tag=_DECISION))
    except MPI.Exception as error:
        if not ulfm.is_process_failure(error):
            raise
        # gone already, or revoked by a failed join: nobody is left to tell


def _layout(specs: Any) -> list[list[Any]]:
    """[[shape, dtype name, bytes]] of (shape, numpy dtype) pairs."""
    return [
        [list(shape), np.dtype(dtype).name, int(np.prod(shape)) * np.dtype(dtype).itemsize]
        for shape, dtype in specs
    ]


def _send_commit(
    intercomm: MPI.Intercomm,
    root: int,
    number: int,
    values: dict[str, Any],
    arrays: list[np.ndarray | None],
    copies: sharded.Copies | None,
) -> None:
    """Rank 0 of the survivors to every replacement: a JSON header (commit
    number, the state's values, the arrays' layout, the sharded slots), then
    each array's bytes (but the sharded slots': None)."""
    sent = [a for a in arrays if a is not None]  # (the same positions on every survivor)
    header = np.frombuffer(
        json.dumps(
            {
                "number": number,
                "values": values,
                "layout": _layout((a.shape, a.dtype) for a in sent),
                "sharded": sharded.described(copies) if copies else None,
            }
        ).encode(),
        np.uint8,
    )
    intercomm.Bcast(_word(header.size), root=root)
    intercomm.Bcast(header, root=root)
    for array in sent:
        intercomm.Bcast(np.ascontiguousarray(array).view(np.uint8).reshape(-1), root=root)


def _receive_commit(
    intercomm: MPI.Intercomm, specs: list[tuple[tuple[int, ...], Any]]
) -> Newest | None:
    """The commit ``_send_commit`` sends, as (number, values, arrays of ``specs``,
    (shape, dtype) pairs, None for a sharded slot, this rank's ``sharded.Copies``
    or None) or None (after receiving it all) if its layout differs."""
    size = _word()
    intercomm.Bcast(size, root=0)
    header = np.empty(size[0], np.uint8)
    intercomm.Bcast(header, root=0)
    header = json.loads(header.tobytes().decode())
    arrays = []
    for _, _, nbytes in header["layout"]:
        arrays.append(np.empty(nbytes, np.uint8))
        intercomm.Bcast(arrays[-1], root=0)
    copies = None if header["sharded"] is None else sharded.newcomers_copies(header["sharded"])
    # (a sharded slot's shape here is its share of this rank's world, if any)
    elsewhere = {slot.position for slot in copies.slots} if copies else set()
    named = sharded.positions_of(copies) if copies else []
    sent = [spec for k, spec in enumerate(specs) if k not in elsewhere]
    if header["layout"] != _layout(sent) or max(named, default=-1) >= len(specs):
        logger.error(
            "mpi_strategy.elastic: this replacement's state (shapes and dtypes %s) "
            "is not the survivors' (%s): the program must build the same state on "
            "every rank.",
            _layout(sent),
            header["layout"],
        )
        return None
    received = iter(a.view(dtype).reshape(shape) for a, (shape, dtype) in zip(arrays, sent))
    return (
        header["number"],
        header["values"],
        [None if k in elsewhere else next(received) for k in range(len(specs))],
        copies,
    )


def flush_sends(timeout_s: float) -> None:
    """Waits (at most ``timeout_s``) for the messages sent to replacements to
    leave this process: before it exits without MPI_Finalize."""
    deadline = time.monotonic() + timeout_s
    while _pending_sends() and time.monotonic() < deadline:
        try:
            if not _pending_sends()[0].Test():
                time.sleep(0.01)
                continue
        except MPI.Exception as error:
            if not ulfm.is_process_failure(error):
                raise
            # its receiver died: the message is not needed any more
        _pending_sends().pop(0)


def join_survivors(
    specs: list[tuple[tuple[int, ...], Any]],
) -> tuple[MPI.Intracomm, Newest]:
    """In a replacement, at ``elastic.run``: tells the survivors it is ready and
    waits for their decision at their next commit. Told to join, receives the
    commit (its arrays must have the (shape, dtype) ``specs`` of this state)
    and returns (the merged communicator, (number, values, arrays, copies):
    ``_receive_commit``); told to
    leave, raises ``SystemExit(0)``: the replacement ends as a finished program."""
    parent, world = MPI.Comm.Get_parent(), MPI.COMM_WORLD
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    world.Barrier()  # every replacement is ready
    decision = _LEAVE
    if world.Get_rank() == 0:
        # Not waited for: a send to a survivor that died may never complete.
        _pending_sends().append(parent.Isend(_word(), dest=0, tag=_READY))
        decision = _wait_for_decision(parent)
    decided = _word(decision)
    world.Bcast(decided, root=0)
    if decided[0] == _SILENT:  # MPI_Finalize could wait for the dead: end at once
        logger.error(
            "mpi_strategy.elastic: no word from the survivors' rank 0 for %d s; "
            "this replacement ends (status 1).",
            SILENCE_S,
        )
        sys.stderr.flush()
        os._exit(1)
    if decided[0] == _LEAVE:
        logger.error(
            "mpi_strategy.elastic: this replacement is not needed any more (the "
            "survivors lost another rank or finished); it ends."
        )
        signal.alarm(0)
        raise SystemExit(0)
    watchdog = threading.Timer(JOIN_TIMEOUT_S, _join_timed_out)
    watchdog.daemon = True
    watchdog.start()
    newest = _receive_commit(parent, specs)
    merged = parent.Merge(high=True)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    fits = newest is not None
    joined = merged.Agree(int(fits))
    watchdog.cancel()
    signal.alarm(0)
    if newest is None or not joined:  # (newest is None: not fits)
        raise MPIStrategyError(
            "mpi_strategy.elastic: this replacement could not join the "
            "survivors (its state does not fit theirs, or another's)."
        )
    return merged, newest


def _wait_for_decision(parent: MPI.Intercomm) -> int:
    """JOIN or LEAVE from a survivor; SILENT after ``SILENCE_S`` without even a
    heartbeat (rank 0 died: Open MPI would not say so). Polls gently: the
    survivors may share the cores."""
    status, heard = MPI.Status(), time.monotonic()
    while time.monotonic() - heard < SILENCE_S:
        message = _word()
        try:
            if not parent.Iprobe(source=MPI.ANY_SOURCE, tag=_DECISION, status=status):
                time.sleep(0.02)
                continue
            parent.Recv(message, source=status.Get_source(), tag=_DECISION)
        except MPI.Exception as error:
            if not ulfm.is_process_failure(error):
                raise
            # The sender finished or died since it spoke (its message may be
            # lost with it): no join can follow without it.
            return _LEAVE
        if message[0] != _HEARTBEAT:
            return int(message[0])
        heard = time.monotonic()
    return _SILENT


def _join_timed_out() -> None:
    logger.error(
        "mpi_strategy.elastic: this replacement was told to join but the join did "
        "not complete in %d s (a survivor died meanwhile?); it ends.",
        JOIN_TIMEOUT_S,
    )
    sys.stderr.flush()
    os._exit(1)
