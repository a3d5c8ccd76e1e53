"""The all-reduce: each tensor reduced element-wise over the ranks ("sum",
"min", "max" or "product"), all of them in one MPI call."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from mpi_strategy._src.core import buffers
from mpi_strategy._src.core.collective_ops.base import (
    CollectiveOp,
    NativeOp,
    Params,
    Runner,
    mpi_dtype,
    mpi_handle,
    same,
    whole,
)
from mpi_strategy._src.core.errors import MPIStrategyError
from mpi_strategy._src.core.kinds import Kind, register_kind
from mpi_strategy._src.core.protocol import Op
from mpi_strategy._src.core.wire import as_bytes

KIND = register_kind(
    Kind(
        1,
        "allreduce",
        (
            "Element-wise reductions need tensors of one shape and dtype on every rank; "
            "per-replica batches of different sizes can only be reduced along an axis "
            "(strategy.reduce(..., axis=0)) or gathered."
        ),
    )
)
_REDUCE_ADVICE = KIND.advice + " All ranks must also use the same reduction op."
MIN = register_kind(Kind(8, "allreduce (min)", _REDUCE_ADVICE))
MAX = register_kind(Kind(9, "allreduce (max)", _REDUCE_ADVICE))
PRODUCT = register_kind(Kind(10, "allreduce (product)", _REDUCE_ADVICE))

# op name -> (the agreement's kind, the MPI op, the numpy ufunc for carried data)
REDUCTIONS: dict[str, tuple[Kind, MPI.Op, np.ufunc]] = {
    "sum": (KIND, MPI.SUM, np.add),
    "min": (MIN, MPI.MIN, np.minimum),
    "max": (MAX, MPI.MAX, np.maximum),
    "product": (PRODUCT, MPI.PROD, np.multiply),
}

# Dtypes MPI can reduce natively. float16 / bfloat16 are summed in float32 by
# the caller (MPI has no portable half-precision reduction).
REDUCIBLE_DTYPES = tuple(
    np.dtype(name)
    for name in (
        "float32",
        "float64",
        "int32",
        "int64",
        "int8",
        "uint8",
        "int16",
        "uint16",
        "uint32",
        "uint64",
    )
)


def numpy(run: Runner, p: Params, token: int, *arrays: np.ndarray) -> list[np.ndarray]:
    """Reduces each of ``arrays`` (one dtype) element-wise over the ranks
    with ``p.op`` (one of ``REDUCTIONS``), in one MPI call.

    The arrays are copied into one pooled buffer, reduced in place and
    handed back as aligned views of it (``buffers.py``). ``p.shapes``: the
    shapes the agreement compares (the caller may have concatenated the
    tensors; default: the arrays' own). Small data is reduced from the
    agreement's records, in rank order, alike on every rank.
    """
    kind, mpi_op, ufunc = REDUCTIONS[p.op]
    buffer, outs = buffers.pack(arrays, run.pool)
    _, carried = run.agreement.agree_carrying(
        as_bytes(buffer),
        kind,
        arrays[0].dtype,
        p.shapes or [a.shape for a in arrays],
        timeout=p.timeout,
        token=token,
    )
    if carried is None:
        run.comm.Allreduce(MPI.IN_PLACE, buffer, op=mpi_op)
    else:
        every_rank = carried[:, : buffer.nbytes].view(buffer.dtype)
        buffer[...] = every_rank[0]
        for row in every_rank[1:]:
            ufunc(buffer, row, out=buffer)
    return outs


def check(dtypes: Sequence[np.dtype]) -> None:
    """Raises unless the tensors have one dtype MPI can reduce."""
    if len(set(dtypes)) != 1 or dtypes[0] not in REDUCIBLE_DTYPES:
        raise MPIStrategyError(
            f"mpi_strategy: cannot reduce dtype(s) {sorted(np.dtype(d).name for d in set(dtypes))} "
            f"in one MPI call; supported: one of {[d.name for d in REDUCIBLE_DTYPES]} "
            "(float16/bfloat16 are summed in float32 by MPICrossDeviceOps)."
        )


def _attrs(p: Params, dtypes: Sequence[np.dtype]) -> dict[str, int]:
    return {
        "op": Op[p.op.upper()].value,
        "mpi_op": mpi_handle(REDUCTIONS[p.op][1]),
        "mpi_dtype": mpi_dtype(dtypes[0]),
        "contiguous": int(p.contiguous),
    }


ALLREDUCE = CollectiveOp(
    name="allreduce",
    op_name="MPIAllreduce",
    kind=lambda p: REDUCTIONS[p.op][0],
    numpy=numpy,
    agreed=whole,
    output_shapes=same,
    identity_on_one_rank=True,
    check=check,
    native=NativeOp(
        "MpiStrategyAllreduce",
        inputs=("inputs",),
        listed=True,
        attrs=_attrs,
        reads=("op", "mpi_op", "mpi_dtype", "contiguous"),
    ),
)
