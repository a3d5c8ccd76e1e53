"""How arrays travel as bytes: one flat byte view, several arrays back to back,
and an all-gathered byte buffer cut back into every rank's arrays."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from mpi_strategy._src.core import buffers
from mpi_strategy._src.core.protocol import PIECE_ALIGN


def as_bytes(array: np.ndarray) -> np.ndarray:
    """A writable-if-possible uint8 view of a C-contiguous array (any dtype)."""
    return array.reshape(-1).view(np.uint8)


def _padded(nbytes: int) -> int:
    return -(-nbytes // PIECE_ALIGN) * PIECE_ALIGN  # every piece starts aligned


def concat_bytes(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The bytes of ``arrays`` back to back, each piece padded to ``PIECE_ALIGN``."""
    sizes = [a.nbytes for a in arrays]
    out = np.zeros(sum(_padded(n) for n in sizes), np.uint8)
    offset = 0
    for a, n in zip(arrays, sizes):
        out[offset : offset + n] = as_bytes(a)
        offset += _padded(n)
    return out


def split_gathered(
    received: np.ndarray, counts: np.ndarray, arrays: Sequence[np.ndarray]
) -> list[np.ndarray]:
    """Every rank's pieces of ``received`` (laid out by ``concat_bytes``),
    concatenated per tensor in rank order; ``arrays`` give dtypes and row shapes.

    The results are aligned views of one new buffer (TensorFlow adopts them
    without a copy). A tensor with as many bytes from every rank at the same
    place in each rank's part (the usual case: equal batches) moves in one
    strided copy.
    """
    k = len(arrays)
    row_bytes = np.array([math.prod(a.shape[1:]) * a.itemsize for a in arrays], np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rows = np.stack([received[s : s + 8 * k].view(np.int64) for s in starts.tolist()])
    nbytes = rows * row_bytes  # [rank, tensor]
    padded = -(-nbytes // PIECE_ALIGN) * PIECE_ALIGN
    offsets = (starts + _padded(8 * k))[:, None] + np.cumsum(padded, axis=1) - padded
    totals = nbytes.sum(axis=0)
    slots = -(-totals // buffers.ALIGN_BYTES) * buffers.ALIGN_BYTES
    out = buffers.aligned_empty((int(slots.sum()),), np.uint8)
    p = len(counts)
    # One strided copy per tensor where every rank's piece has the same size
    # and place in its part (equal batches); else one copy per rank.
    strided = (
        np.all(counts == counts[0])
        & np.all(nbytes == nbytes[0], axis=0)
        & np.all(offsets - starts[:, None] == offsets[0], axis=0)
    ).tolist()
    blocks = received.reshape(p, -1) if any(strided) else None
    outs = []
    for i, (a, at, total, one, first, n_rows) in enumerate(
        zip(
            arrays,
            (np.cumsum(slots) - slots).tolist(),
            totals.tolist(),
            nbytes[0].tolist(),
            offsets[0].tolist(),
            rows.sum(axis=0).tolist(),
        )
    ):
        flat = out[at : at + total]
        if strided[i]:
            assert blocks is not None  # (any(strided))
            if one:
                flat.reshape(p, one)[...] = blocks[:, first : first + one]
        else:
            done = 0
            for offset, size in zip(offsets[:, i].tolist(), nbytes[:, i].tolist()):
                flat[done : done + size] = received[offset : offset + size]
                done += size
        outs.append(flat.view(a.dtype).reshape((n_rows, *a.shape[1:])))
    return outs


def word(value: int = 0) -> np.ndarray:
    """A message of one int64: raw buffers only, nothing is unpickled (docs/security.md)."""
    return np.array([value], np.int64)
