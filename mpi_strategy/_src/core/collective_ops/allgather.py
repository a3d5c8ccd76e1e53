"""The all-gather: each tensor concatenated along axis 0 over the ranks, in rank order."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpi_strategy._src.core import buffers
from mpi_strategy._src.core.collective_ops.base import (
    CollectiveOp,
    NativeOp,
    Params,
    Runner,
    beyond_rows,
    every_dtype,
    rows_unknown,
)
from mpi_strategy._src.core.kinds import Kind, register_kind
from mpi_strategy._src.core.protocol import Field, dtype_name
from mpi_strategy._src.core.wire import concat_bytes, split_gathered


def _wording(signature: np.ndarray) -> str:
    """An all-gather's signature in words (its rows; its tensors, when several)."""
    rows, count = signature[Field.ROWS], signature[Field.COUNT]
    if signature[Field.TENSORS] != 1:
        return (
            f"all_gather of {signature[Field.TENSORS]} tensors ({rows} rows, "
            f"{count} elements per row in all)"
        )
    return (
        f"all_gather of {rows} rows of {count} {dtype_name(int(signature[Field.DTYPE]))} elements"
    )


KIND = register_kind(
    Kind(
        2,
        "all_gather",
        (
            "Every rank must gather the same tensors, each of one dtype and with "
            "shapes that agree except along the gather axis."
        ),
        wording=_wording,
        own_bytes=True,
    )
)


def numpy(run: Runner, p: Params, token: int, *arrays: np.ndarray) -> list[np.ndarray]:
    """Each of ``arrays`` concatenated along axis 0 over the ranks, in rank
    order (any dtypes; row counts may differ per rank), in one Allgatherv
    of bytes: each rank sends its row counts, then every array's bytes."""
    arrays = tuple(np.ascontiguousarray(a) for a in arrays)
    rows = np.array([a.shape[0] if a.ndim else 1 for a in arrays], np.int64)
    mine = concat_bytes([rows, *arrays])
    everyone, carried = run.agreement.agree_carrying(
        mine,
        KIND,
        [a.dtype for a in arrays],
        [a.shape[1:] for a in arrays],
        rows=int(rows.sum()),
        timeout=p.timeout,
        token=token,
    )
    counts = everyone[:, Field.BYTES]
    if carried is None:
        received = buffers.aligned_empty((int(counts.sum()),), np.uint8)
        run.comm.Allgatherv(mine, [received, (counts.tolist(), None), MPI.BYTE])
    else:
        received = np.concatenate([row[:n] for row, n in zip(carried, counts)])
    return split_gathered(received, counts, list(arrays))


ALLGATHER = CollectiveOp(
    name="allgather",
    op_name="MPIAllgather",
    kind=lambda p: KIND,
    numpy=numpy,
    agreed=beyond_rows,
    output_shapes=rows_unknown,
    dtypes=every_dtype,
    identity_on_one_rank=True,
    native=NativeOp("MpiStrategyAllgather", inputs=("inputs",), listed=True),
)
