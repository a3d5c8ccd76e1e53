"""The reduce-scatter: a reduction cut into row shares, one per rank."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from mpi_strategy._src.core import buffers
from mpi_strategy._src.core.collective_ops.allreduce import REDUCTIONS
from mpi_strategy._src.core.collective_ops.base import (
    CollectiveOp,
    NativeOp,
    Params,
    Runner,
    mpi_dtype,
    mpi_handle,
    rows_unknown,
    whole,
)
from mpi_strategy._src.core.kinds import Kind, register_kind

KIND = register_kind(
    Kind(
        11,
        "reducescatter",
        "A reduce-scatter needs a tensor of one shape and dtype on every rank, "
        "reduced with the same op.",
    )
)


def row_split(rows: int, parts: int) -> list[int]:
    """``rows`` cut into ``parts`` as evenly as possible, the larger pieces first."""
    return [rows // parts + (1 if r < rows % parts else 0) for r in range(parts)]


def tag(p: Params) -> str:
    return p.op  # (the ranks must reduce with the same op)


def numpy(run: Runner, p: Params, token: int, array: np.ndarray) -> list[np.ndarray]:
    """``array`` (one shape and dtype on every rank, at least one axis)
    reduced with ``p.op``, then cut along axis 0: rank ``r`` gets the rows
    ``row_split(len(array), size)[r]`` (the first ``len % size`` ranks one
    row more than the others)."""
    _, mpi_op, _ = REDUCTIONS[p.op]
    array = np.ascontiguousarray(array)
    run.agreement.agree(
        KIND, array.dtype, [array.shape], timeout=p.timeout, tag=tag(p), token=token
    )
    row = math.prod(array.shape[1:])
    counts = [n * row for n in row_split(array.shape[0], run.size)]
    rows = row_split(array.shape[0], run.size)[run.rank]
    out = buffers.aligned_empty((rows, *array.shape[1:]), array.dtype)
    if array.size:
        run.comm.Reduce_scatter(array.reshape(-1), out.reshape(-1), counts, op=mpi_op)
    return [out]


def _attrs(p: Params, dtypes: Sequence[np.dtype]) -> dict[str, int]:
    return {"mpi_op": mpi_handle(REDUCTIONS[p.op][1]), "mpi_dtype": mpi_dtype(dtypes[0])}


REDUCESCATTER = CollectiveOp(
    name="reducescatter",
    op_name="MPIReducescatter",
    kind=lambda p: KIND,
    numpy=numpy,
    agreed=whole,
    output_shapes=rows_unknown,
    tag=tag,
    native=NativeOp(
        "MpiStrategyReducescatter",
        attrs=_attrs,
        reads=("mpi_op", "mpi_dtype"),
        # (a scalar: the Python engine explains)
        runs=lambda p, size: p.shapes is not None and len(p.shapes[0]) > 0,
    ),
)
