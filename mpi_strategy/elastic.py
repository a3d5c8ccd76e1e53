"""Elastic training: lose ranks and keep training, in place, without a relaunch.

    mpirun --with-ft ulfm -n 4 python train.py      # Open MPI 5 with ULFM

    strategy = MPIStrategy()
    with strategy.scope():
        model, optimizer = ...
    state = mpi_strategy.elastic.State(model, optimizer, step=0)

    @mpi_strategy.elastic.run(strategy, state)
    def train(state):
        step_fn = tf.function(...)          # traced again after every recovery
        while state.step < STEPS:
            ... one step on the batch of step state.step ...
            state.step += 1
            if state.step % 10 == 0:
                state.commit()              # in memory, the same on every rank

    train()

What happens when a rank dies, and with ``replace_lost=True``: see ``run``
and docs/elastic.md. ``recoveries`` and ``replacements`` record, per process,
when each recovery and each join of replacements happened and how long its
parts took.
"""

from mpi_strategy._src.core.errors import RanksLostError, TooFewRanksError
from mpi_strategy._src.core.ulfm import is_replacement
from mpi_strategy._src.features.elastic.recovery import StaleCollectiveError, record as _record
from mpi_strategy._src.features.elastic.run import KerasCallback, run
from mpi_strategy._src.features.elastic.sharded import ShardLostError
from mpi_strategy._src.features.elastic.state import State

# This process's records (the same lists for its whole life).
recoveries = _record().recoveries
replacements = _record().replacements

__all__ = [
    "State",
    "run",
    "KerasCallback",
    "is_replacement",
    "RanksLostError",
    "TooFewRanksError",
    "StaleCollectiveError",
    "ShardLostError",
    "recoveries",
    "replacements",
]
