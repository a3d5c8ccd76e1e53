"""Replacing lost ranks: new processes join the survivors at a commit.

With ``elastic.run(..., replace_lost=True)``, after a recovery that left fewer
ranks than the job had, the survivors start as many new processes of the same
program (``MPI_Comm_spawn``: same interpreter, arguments, working directory and
environment) and go on training meanwhile. A replacement runs the program from
its start up to ``elastic.run`` (importing TensorFlow, building the strategy
and the model on its own), says that it is ready, and waits. At the first
commit after that, every survivor and every replacement meet: the world grows
back (the survivors keep their ranks, the replacements come after them), rank
0 sends the commit just made, and every rank calls the function again.

Spawning runs in a background thread, since ``MPI_Comm_spawn`` returns only
once the new processes initialised MPI; the thread uses its own duplicate of
the survivors' communicator. A rank lost before the replacements joined
abandons them (they leave) and the survivors spawn a new set.
"""

import json
import os
import sys
import threading
import time

from mpi4py import MPI

from mpi_strategy.errors import MPIStrategyError
from mpi_strategy.logs import logger

_READY, _DECISION = 7301, 7302  # tags: replacements -> survivors' rank 0, and back
WAIT, JOIN, GIVE_UP, LEAVE = 0, 1, 2, 3  # decisions
_SPAWN_WAIT_S = 120  # longest wait for a spawn to return when its replacements must leave

# Run by a replacement's interpreter: the survivors' environment and working
# directory first (the launcher gives spawned processes its own environment),
# then MPI_Init (the survivors' spawn returns), then the program as __main__.
_BOOT = """\
import json, os, runpy, sys
for name, value in json.loads(sys.argv[1]).items():
    os.environ.setdefault(name, value)
os.chdir(sys.argv[2])
from mpi4py import MPI
kind, target, sys.argv = sys.argv[3], sys.argv[4], sys.argv[4:]
if kind == "module":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    sys.path[0] = os.path.dirname(os.path.abspath(target))
    runpy.run_path(target, run_name="__main__")
"""


def is_replacement():
    """True in a process that ``replace_lost`` started to replace a lost rank."""
    return MPI.Comm.Get_parent() != MPI.COMM_NULL


def program_command():
    """(interpreter options, "script" or "module", target, arguments) of this
    process, to start it again; raises if it was not started as
    ``python [options] script.py ...`` or ``python [options] -m module ...``."""
    argv = list(getattr(sys, "orig_argv", []))
    head = argv[:len(argv) - (len(sys.argv) - 1)]
    if len(head) >= 3 and head[-2] == "-m":
        return head[1:-2], "module", head[-1], sys.argv[1:]
    if len(head) >= 2 and head[-1].startswith("-m") and len(head[-1]) > 2:
        return head[1:-1], "module", head[-1][2:], sys.argv[1:]
    if len(head) >= 2 and not head[-1].startswith("-") and os.path.isfile(head[-1]):
        return head[1:-1], "script", head[-1], sys.argv[1:]
    raise MPIStrategyError(
        "mpi_strategy.elastic.run(replace_lost=True) starts the program again for each "
        "lost rank: run it as `python train.py ...` or `python -m package.module ...` "
        f"(this process: {argv or sys.argv}).")


class Spawning:
    """Replacements being started for the survivors of ``comm`` (collective)."""

    def __init__(self, comm, count):
        self.count = count
        self.started_at = time.time()
        self.spawned_at = None
        self._rank = comm.Get_rank()
        self._spawn_comm, self._decide_comm = comm.Dup(), comm.Dup()
        self._intercomm, self._error = None, None
        self._command = program_command() if self._rank == 0 else None
        self._thread = threading.Thread(target=self._spawn, daemon=True,
                                        name="mpi_strategy-spawn")
        self._thread.start()

    def _spawn(self):
        args = None
        if self._rank == 0:
            options, kind, target, arguments = self._command
            args = [*options, "-c", _BOOT, json.dumps(dict(os.environ)), os.getcwd(),
                    kind, target, *arguments]
        try:
            intercomm = self._spawn_comm.Spawn(sys.executable, args=args,
                                               maxprocs=self.count, root=0)
            intercomm.Set_errhandler(MPI.ERRORS_RETURN)
            self._intercomm = intercomm
        except MPI.Exception as error:
            self._error = error
        self.spawned_at = time.time()

    def decide(self):
        """At a commit, on every survivor: ``JOIN`` once every replacement is
        ready, ``GIVE_UP`` if they could not be started, else ``WAIT``.
        Raises ``MPI.Exception`` if a survivor died."""
        decision = WAIT
        if self._rank == 0 and not self._thread.is_alive():
            if self._error is not None:
                decision = GIVE_UP
            elif self._intercomm.Iprobe(source=0, tag=_READY):
                decision = JOIN
        decision = self._decide_comm.bcast(decision, root=0)
        if decision == GIVE_UP:
            self._thread.join()
            logger.warning("mpi_strategy.elastic: could not start %d replacement(s) (%s); "
                           "training goes on without them.", self.count,
                           self._error.Get_error_string() if self._error else "see rank 0")
        return decision

    def join(self, snapshot):
        """Every survivor: merges with the ready replacements and sends them
        ``snapshot`` (rank 0's is sent); returns the merged communicator
        (survivors first). Raises ``MPI.Exception`` if a rank died."""
        self._thread.join()  # the spawn returns on rank 0 first
        root = MPI.ROOT if self._rank == 0 else MPI.PROC_NULL
        if self._rank == 0:
            self._intercomm.recv(source=0, tag=_READY)
            self._intercomm.send(JOIN, dest=0, tag=_DECISION)
        self._intercomm.bcast(snapshot, root=root)  # to the replacements only
        merged = self._intercomm.Merge(high=False)
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        merged.Agree(1)  # every rank holds the state: else all of them raise
        return merged

    def dismiss(self, speaker):
        """The replacements will not join (ranks were lost again, or the program
        ends): ``speaker`` (one living survivor) tells them to leave. A message,
        not a revoke: Open MPI 5.0 does not tell spawned processes that a
        process of their parents' job died (measured), so they must not wait
        for an event that never comes."""
        self._thread.join(_SPAWN_WAIT_S)
        if not speaker or self._intercomm is None:
            if speaker and self._thread.is_alive():
                logger.error("mpi_strategy.elastic: the spawn of %d replacement(s) did not "
                             "return in %d s; they may be left waiting.", self.count,
                             _SPAWN_WAIT_S)
            return
        try:
            self._intercomm.send(LEAVE, dest=0, tag=_DECISION)
        except MPI.Exception:
            pass  # the replacement is gone already


def join_survivors():
    """In a replacement, at ``elastic.run``: tells the survivors it is ready and
    waits for their decision at their next commit. Returns (the merged
    communicator, the state snapshot rank 0 sent) or, told to leave, raises
    ``SystemExit(0)``: the replacement ends as a program that finished."""
    parent, world = MPI.Comm.Get_parent(), MPI.COMM_WORLD
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    world.Barrier()  # every replacement is ready
    decision = LEAVE
    if world.Get_rank() == 0:
        # Not waited for: a send to a survivor that died may never complete.
        parent.isend(None, dest=0, tag=_READY)
        decision = parent.recv(source=MPI.ANY_SOURCE, tag=_DECISION)
    if world.bcast(decision, root=0) == LEAVE:
        logger.error("mpi_strategy.elastic: this replacement is not needed any more "
                     "(the survivors lost another rank or finished); it ends.")
        raise SystemExit(0)
    snapshot = parent.bcast(None, root=0)
    merged = parent.Merge(high=True)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    merged.Agree(1)
    return merged, snapshot
