"""The agreement and the ordered collectives of the core at many ranks, without TensorFlow.

    mpiexec -n 40 python tests/programs/agreement_at_scale.py

Beyond 32 ranks each rank's agreement record shrinks (``record_bytes``), so
less data is carried; this runs the collectives there, oversubscribed: a
carried and a sent reduction, an uneven all-gather, a broadcast, a mismatch
(whose message names every rank), a constant that ranks assumed equal but
is not (the ordering token), and the communicator still working after them;
then all of it again with the hashed agreement (which the library uses above
``protocol.HASHED_ABOVE`` ranks; here forced).
Only numpy and mpi4py are imported (the package's __init__ would load
TensorFlow in every one of the ranks); rank 0 prints "OK <ranks>" at the end.
"""

import os
import sys
import types

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
package = types.ModuleType("mpi_strategy")  # the core, without mpi_strategy/__init__.py
package.__path__ = [os.path.join(REPO, "mpi_strategy")]
sys.modules["mpi_strategy"] = package

import numpy as np
from mpi4py import MPI

from mpi_strategy._src.core import protocol
from mpi_strategy._src.core.collectives import ArrayCollectives
from mpi_strategy._src.core.errors import MPIStrategyError
from mpi_strategy._src.core.protocol import record_bytes

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


def check(ok: bool, what: str) -> None:
    # Every rank learns whether every rank passed: all fail together.
    if not WORLD.allreduce(bool(ok), op=MPI.LAND):
        print(f"rank {RANK}: FAILED: {what}", flush=True)
        sys.exit(1)


def main() -> None:
    gathered = ArrayCollectives(WORLD)
    run(gathered)
    protocol.HASHED_ABOVE = 32
    hashed = ArrayCollectives(WORLD)
    check(hashed.agreement.hashed, "the hashed agreement is in use")
    run(hashed)
    check("tensorflow" not in sys.modules, "no TensorFlow imported")
    if RANK == 0:
        carry = gathered.agreement.carry_bytes
        print(f"OK {SIZE} ranks, record {record_bytes(SIZE)} bytes, carried {carry}", flush=True)


def run(collectives: ArrayCollectives) -> None:
    carry = collectives.agreement.carry_bytes
    token = 0

    def next_token(step: int = 1) -> int:
        nonlocal token
        token += step
        return token

    # Carried: fits in the record on every rank; sent: one more MPI call.
    small = np.full(carry // 8, RANK + 1, np.float64)
    (total,) = collectives.allreduce([small], token=next_token())
    check(np.all(total == SIZE * (SIZE + 1) / 2), "a carried sum")
    large = np.full(10 * carry, RANK, np.int64)
    (largest,) = collectives.allreduce([large], "max", token=next_token())
    check(np.all(largest == SIZE - 1), "a sent max")
    rows = collectives.allgather([np.full((RANK % 3, 2), RANK, np.int32)], token=next_token())[0]
    expected = np.concatenate([np.full((r % 3, 2), r, np.int32) for r in range(SIZE)])
    check(np.array_equal(rows, expected), "an uneven all-gather")
    root = SIZE - 1
    got = collectives.broadcast(np.arange(5.0) * RANK, root, token=next_token())
    check(np.array_equal(got, np.arange(5.0) * root), "a broadcast")

    # Rank 0 reduces 3 elements, the others 2: every rank raises, naming all.
    try:
        collectives.allreduce([np.ones(3 if RANK == 0 else 2)], token=next_token())
        message = ""
    except MPIStrategyError as error:
        message = str(error)
    named = "rank 0: allreduce of 3 float64" in message and (
        f"rank {SIZE - 1}: allreduce of 2 float64" in message
    )
    check(named, f"the mismatch message names every rank: {message[:300]!r}")

    # A constant assumed equal but different on the last rank moves its token.
    step = 2 if RANK == SIZE - 1 else 1
    try:
        collectives.allreduce([np.ones(1)], token=next_token(step))
        message = ""
    except MPIStrategyError as error:
        message = str(error)
    check("ordering token moved by 2" in message, f"a constant that differs: {message[:300]!r}")

    (after,) = collectives.allreduce([np.ones(4)], token=next_token())
    check(np.all(after == SIZE), "the communicator after the errors")


if __name__ == "__main__":
    main()
