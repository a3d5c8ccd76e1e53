"""The barrier: every rank waits for the others (the agreement alone, no data)."""

from __future__ import annotations

import numpy as np

from mpi_strategy._src.core.collective_ops.base import CollectiveOp, NativeOp, Params, Runner
from mpi_strategy._src.core.kinds import Kind, register_kind

KIND = register_kind(Kind(13, "barrier", meeting=True))


def numpy(run: Runner, p: Params, token: int | None) -> list[np.ndarray]:
    """[a scalar 0], once every rank has called it (a timeout names the late ranks)."""
    run.agreement.agree(KIND, np.uint8, [], timeout=p.timeout, token=token)
    return [np.asarray(np.int32(0))]


BARRIER = CollectiveOp(
    name="barrier",
    op_name="MPIBarrier",
    kind=lambda p: KIND,
    numpy=numpy,
    agreed=lambda dims: (),
    output_shapes=lambda dims, size: [()],
    dtypes=lambda dtypes: [np.dtype(np.uint8)],
    output_dtypes=("int32",),
    native=NativeOp("MpiStrategyBarrier", inputs=()),
)
