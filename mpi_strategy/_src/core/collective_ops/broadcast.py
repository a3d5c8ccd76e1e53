"""The broadcast: one tensor as it is on the root rank."""

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
    same,
    whole,
)
from mpi_strategy._src.core.kinds import Kind, register_kind
from mpi_strategy._src.core.wire import as_bytes

KIND = register_kind(
    Kind(
        3,
        "broadcast",
        (
            "All ranks must create the same variables, in the same order, with the "
            "same shapes and dtypes (build the model identically on every rank)."
        ),
    )
)


def tag(p: Params) -> str:
    return f"root {p.root}"  # (the ranks must name the same root)


def numpy(run: Runner, p: Params, token: int, array: np.ndarray) -> list[np.ndarray]:
    """``array`` as it is on ``p.root``; ranks whose arrays differ in size or
    dtype raise (they are not running the same program)."""
    out = buffers.aligned_empty(array.shape, array.dtype)
    out[...] = array
    _, carried = run.agreement.agree_carrying(
        as_bytes(out),
        KIND,
        array.dtype,
        [array.shape],
        timeout=p.timeout,
        token=token,
        tag=tag(p),
    )
    if carried is None:
        run.comm.Bcast([as_bytes(out), MPI.BYTE], root=p.root)
    else:
        as_bytes(out)[...] = carried[p.root, : out.nbytes]
    return [out]


def _attrs(p: Params, dtypes: Sequence[np.dtype]) -> dict[str, int]:
    return {"root": p.root}


BROADCAST = CollectiveOp(
    name="broadcast",
    op_name="MPIBroadcast",
    kind=lambda p: KIND,
    numpy=numpy,
    agreed=whole,
    output_shapes=same,
    tag=tag,
    identity_on_one_rank=True,
    native=NativeOp("MpiStrategyBroadcast", attrs=_attrs, reads=("root",)),
)
