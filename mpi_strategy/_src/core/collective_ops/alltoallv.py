"""The alltoall with splits: the first ``splits[r]`` rows after those for
lower ranks go to rank ``r``; every rank learns what came from each rank."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from mpi_strategy._src.core import buffers
from mpi_strategy._src.core.collective_ops.base import (
    CollectiveOp,
    Dims,
    NativeOp,
    Params,
    Runner,
    beyond_rows,
)
from mpi_strategy._src.core.kinds import Kind, register_kind
from mpi_strategy._src.core.wire import as_bytes

KIND = register_kind(
    Kind(
        12,
        "alltoall (splits)",
        "Every rank must send tensors of one dtype whose shapes agree except along "
        "the first axis, split in as many pieces as there are ranks.",
    )
)


def numpy(
    run: Runner, p: Params, token: int, array: np.ndarray, splits: np.ndarray
) -> list[np.ndarray]:
    """Rows ``splits[0]`` of ``array`` go to rank 0, the next ``splits[1]``
    to rank 1, and so on; returns [the rows received, in rank order; how
    many came from each rank]. Shapes beyond axis 0 and the dtype must agree."""
    array = np.ascontiguousarray(array)
    counts = np.asarray(splits, np.int64).reshape(-1)
    rows = array.shape[0] if array.ndim else -1
    # This rank's counts, then whether they fit its array: every rank
    # learns every rank's, so bad counts raise on every rank.
    sent = np.zeros(run.size + 1, np.int64)
    sent[: min(run.size, counts.size)] = counts[: run.size]
    sent[-1] = counts.size == run.size and bool((counts >= 0).all()) and counts.sum() == rows
    _, carried = run.agreement.agree_carrying(
        as_bytes(sent), KIND, array.dtype, [array.shape[1:]], timeout=p.timeout, token=token
    )
    if carried is None:
        matrix = np.empty((run.size, run.size + 1), np.int64)
        run.comm.Allgather([sent, MPI.INT64_T], [matrix, MPI.INT64_T])
    else:
        matrix = carried[:, : sent.nbytes].copy().view(np.int64)
    if not matrix[:, -1].all():
        raise run.bad_splits(matrix, counts.tolist(), rows)
    received = matrix[:, run.rank].copy()
    row_bytes = math.prod(array.shape[1:]) * array.itemsize
    out = buffers.aligned_empty((int(received.sum()), *array.shape[1:]), array.dtype)
    send_counts, recv_counts = sent[:-1] * row_bytes, received * row_bytes
    run.comm.Alltoallv(
        [as_bytes(array), (send_counts.tolist(), _starts(send_counts)), MPI.BYTE],
        [as_bytes(out), (recv_counts.tolist(), _starts(recv_counts)), MPI.BYTE],
    )
    return [out, received]


def _starts(counts: np.ndarray) -> list[int]:
    return (np.cumsum(counts) - counts).tolist()


def _output_shapes(dims: Sequence[Dims], size: int) -> list[Dims]:
    x = dims[0]
    return [None if x is None else (None, *x[1:]), (size,)]


ALLTOALLV = CollectiveOp(
    name="alltoallv",
    op_name="MPIAlltoall",
    kind=lambda p: KIND,
    numpy=numpy,
    # (the agreement compares the data's shape beyond axis 0, not the splits')
    agreed=lambda dims: beyond_rows(dims[:1]),
    output_shapes=_output_shapes,
    native=NativeOp("MpiStrategyAlltoallv", inputs=("input", "splits")),
)
