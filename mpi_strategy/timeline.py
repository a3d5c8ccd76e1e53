"""An opt-in timeline of every collective, per process (``MPI_STRATEGY_TIMELINE``).

    MPI_STRATEGY_TIMELINE=trace.json mpiexec -n 2 python train.py
    python -m mpi_strategy timeline trace.json     # merge the ranks' files into trace.json

See docs/timeline.md.
"""

from mpi_strategy._src.core.timeline import ENV_VAR, main, merge, rank_path, read_events

__all__ = ["ENV_VAR", "merge", "rank_path", "read_events", "main"]
