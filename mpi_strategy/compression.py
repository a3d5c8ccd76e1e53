"""How large floating-point sums travel: exactly (the default), or in 16 bits.

``MPIStrategy(compression="float16")`` (or ``"bfloat16"``), or a policy object:
``SixteenBit("bfloat16", min_bytes=...)`` for another threshold, or your own
``CompressionPolicy``, which receives the strategy's ``Collectives``. The
policy is checked when the strategy is built (``TypeError`` / ``ValueError``
saying what is wrong, on every rank). How the 16-bit sum moves the bytes and
rounds: ``mpi_strategy/_src/distribute/compression.py``.
"""

from mpi_strategy._src.distribute.compression import (
    MIN_BYTES,
    Collectives,
    CompressionPolicy,
    Exact,
    SixteenBit,
    check_policy,
    resolve,
)

__all__ = [
    "CompressionPolicy",
    "Collectives",
    "Exact",
    "SixteenBit",
    "MIN_BYTES",
    "check_policy",
    "resolve",
]
