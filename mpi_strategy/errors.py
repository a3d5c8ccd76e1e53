"""Exceptions raised by mpi_strategy (the same exception on every rank)."""


class MPIStrategyError(RuntimeError):
    """A misuse or failure that mpi_strategy detected; the message says how to fix it."""
