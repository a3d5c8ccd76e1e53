"""The alltoall (equal splits): row r of each rank's tensor goes to rank r."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpi_strategy._src.core import buffers
from mpi_strategy._src.core.collective_ops.base import (
    CollectiveOp,
    NativeOp,
    Params,
    Runner,
    same,
    whole,
)
from mpi_strategy._src.core.kinds import Kind, register_kind
from mpi_strategy._src.core.wire import as_bytes

KIND = register_kind(
    Kind(
        4,
        "alltoall",
        (
            "A compressed reduction (compression=...) needs the same tensors on every "
            "rank; the ranks are reducing different gradients (build the model "
            "identically on every rank) or use different compression settings."
        ),
    )
)


def numpy(run: Runner, p: Params, token: int, array: np.ndarray) -> list[np.ndarray]:
    """Row ``r`` of ``array`` goes to rank ``r``; row ``r`` of the result
    came from rank ``r``. ``array`` has one row per rank."""
    if array.ndim == 0 or array.shape[0] != run.size:
        raise run.mismatch_error(
            f"mpi_strategy: alltoall needs one row per rank ({run.size}), got shape {array.shape}."
        )
    array = np.ascontiguousarray(array)
    run.agreement.agree(KIND, array.dtype, [array.shape], timeout=p.timeout, token=token)
    out = buffers.aligned_empty(array.shape, array.dtype)
    run.comm.Alltoall([as_bytes(array), MPI.BYTE], [as_bytes(out), MPI.BYTE])
    return [out]


ALLTOALL = CollectiveOp(
    name="alltoall",
    op_name="MPIAlltoall",
    kind=lambda p: KIND,
    numpy=numpy,
    agreed=whole,
    output_shapes=same,
    identity_on_one_rank=True,
    native=NativeOp(
        "MpiStrategyAlltoall",
        # (without one row per rank: the Python engine explains)
        runs=lambda p, size: p.shapes is not None and p.shapes[0][:1] == (size,),
    ),
)
