"""Growing back (``replace_lost=True``), on the survivors' side: after a
recovery, replacements are spawned for the lost ranks; at the first commit
once they are ready, they join (their side: ``replacement.py``)."""

from __future__ import annotations

import time

from mpi4py import MPI

from mpi_strategy._src.core import ulfm
from mpi_strategy._src.core.logs import logger
from mpi_strategy._src.distribute.strategy import MPIStrategy
from mpi_strategy._src.features.elastic import recovery, replacement, state as state_lib
from mpi_strategy._src.features.elastic.state import State

_SPAWN_WAIT_AT_END_S = 60  # at the program's end, for a spawn to return (then: leave)


class WorldGrew(Exception):
    """Raised by a commit at which replacements joined: the function is called again."""


class Regrowth:
    """Replacements for the ranks lost since ``strategy`` was first this size."""

    def __init__(self, strategy: MPIStrategy, state: State) -> None:
        replacement.check_can_replace()
        self._strategy, self._state = strategy, state
        self._size = strategy.extended.comm.Get_size()  # the world to return to
        self._spawning: replacement.Spawning | None = None
        self._dismissed: list[replacement.Spawning] = []  # still to be told to leave
        state_lib.on_commit(state, self._at_commit)

    def after_recovery(self) -> None:
        """Starts replacements for the ranks missing now (collective)."""
        self._dismiss()
        missing = self._size - self._strategy.extended.comm.Get_size()
        if missing > 0:
            self._spawning = replacement.Spawning(self._strategy.extended.comm, missing)
            logger.warning(
                "mpi_strategy.elastic: starting %d replacement(s); they join "
                "at the first commit once they are ready",
                missing,
            )

    def stop(self) -> None:
        """The program ends: replacements not joined yet leave."""
        state_lib.on_commit(self._state, None)
        self._dismiss(wait_s=_SPAWN_WAIT_AT_END_S)
        if self._dismissed:
            logger.error(
                "mpi_strategy.elastic: a spawn of replacements did not return in "
                "%d s; they end on their own within %d s.",
                _SPAWN_WAIT_AT_END_S,
                replacement.START_LIMIT_S,
            )
        replacement.flush_sends(_SPAWN_WAIT_AT_END_S)

    def _dismiss(self, wait_s: float = 0.0) -> None:
        if self._spawning is not None:
            self._dismissed.append(self._spawning)
            self._spawning = None
        self._dismissed = [s for s in self._dismissed if not s.dismiss(wait_s)]

    def _at_commit(self) -> None:
        if self._dismissed:
            self._dismiss()  # their spawn may have returned since
        spawning = self._spawning
        if spawning is None:
            return
        ordered = self._strategy.extended.ordered_comm
        try:
            decision = spawning.decide()
            if decision == replacement.WAIT:
                return
            started = time.monotonic()
            merged = None
            if decision == replacement.JOIN:
                merged = spawning.join(state_lib.newest(self._state))
        except MPI.Exception as error:
            if not ulfm.is_process_failure(error):
                raise
            # Revoked: the survivors in another collective raise too; the
            # recovery then tells the replacements to leave.
            raise ordered.ranks_lost(error) from error
        self._spawning = None
        if merged is None:
            return  # given up: training goes on with the survivors
        before = ordered.size
        recovery.grown(self._strategy, self._state, merged)
        recovery.record().replacements.append(
            {
                "started_at": spawning.started_at,
                "spawned_at": spawning.spawned_at,
                "joined_at": time.time(),
                "join_s": time.monotonic() - started,
                "ranks_before": before,
                "ranks_after": merged.Get_size(),
                "commit": self._state.commit_number,
            }
        )
        logger.warning(
            "mpi_strategy.elastic: %d replacement(s) joined: continuing on %d "
            "ranks from commit #%d (%.1f s after they were started)",
            merged.Get_size() - before,
            merged.Get_size(),
            self._state.commit_number,
            time.time() - spawning.started_at,
        )
        raise WorldGrew()
