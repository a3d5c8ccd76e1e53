"""Where MPI results live: aligned buffers that TensorFlow adopts without a copy.

A ``tf.numpy_function`` output becomes a tensor without a copy only when its
data is 64-byte aligned; otherwise TensorFlow copies it. In graph mode the
tensor then *is* the numpy memory, so a buffer must never be written again
while any tensor still views it.

``BufferPool`` hands out aligned buffers and takes back, for the next call,
a buffer whose views TensorFlow has all dropped (seen from a weak reference:
see ``BufferPool``). Reusing memory avoids the page faults of fresh
pages and lets the MPI library reuse what it set up for that address (its
shared-memory transport registers buffers), so a copy into a reused buffer
and an in-place reduction of it beat reducing a fresh tensor's memory
(measured in docs/contributing.md, "Measurements behind the design").
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import DTypeLike

from mpi_strategy._src.core import protocol

ALIGN_BYTES = protocol.PACK_ALIGN  # (also what TensorFlow adopts without a copy)
_POOLED_MIN_BYTES = 1 << 16  # smaller buffers come from malloc's heap, no page faults
_POOL_SIZE = 4


def aligned_empty(shape: int | tuple[int, ...], dtype: DTypeLike) -> np.ndarray:
    """A fresh, uninitialised array that TensorFlow can adopt without a copy."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN_BYTES, np.uint8)
    start = -raw.ctypes.data % ALIGN_BYTES
    return raw[start : start + nbytes].view(dtype).reshape(shape)


class BufferPool:
    """Aligned 1-D buffers, reused once no array viewing them is alive.

    Each pooled slot of memory is handed out as a *lease*: a fresh array made
    by ``np.frombuffer`` over the slot, which the pool references only
    weakly. numpy points every view of a view at the first array up the chain
    that owns its data or whose base is not an array: for views cut from the
    lease, that is the lease, whose base is a ``memoryview``. So every array
    whose memory lies in the slot holds the lease, directly or (subclass
    views, buffer-protocol exports such as ``memoryview`` or TensorFlow's
    adoption of a ``numpy_function`` result) through the array it came from,
    and the slot is free exactly when the lease is dead. Unlike counting
    references, this does not depend on how an interpreter counts them; where
    weak references are cleared late (an object in a reference cycle, another
    Python implementation), a slot is only reused later, never too early.

    Not thread-safe by itself: callers run under the GIL inside one ordered
    op at a time (the numpy functions of one communicator are serialised).
    """

    def __init__(self) -> None:
        self._slots: list[_Slot] = []  # at most _POOL_SIZE

    def empty(self, count: int, dtype: DTypeLike) -> np.ndarray:
        """An uninitialised aligned array of ``count`` elements of ``dtype``."""
        nbytes = count * np.dtype(dtype).itemsize
        if nbytes < _POOLED_MIN_BYTES:
            return aligned_empty((count,), dtype)
        size = nbytes + ALIGN_BYTES
        for slot in self._slots:
            if slot.size == size and slot.lease() is None:
                break
        else:
            slot = _Slot(size)
            if len(self._slots) < _POOL_SIZE:
                self._slots.append(slot)
        lease = np.frombuffer(slot.memory, dtype, count, slot.start)
        slot.lease = weakref.ref(lease)
        return lease


def _dead() -> None:
    return None


class _Slot:
    """Pooled memory and a weak reference to its current lease (if any)."""

    __slots__ = ("size", "memory", "start", "lease")

    def __init__(self, size: int) -> None:
        raw = np.empty(size, np.uint8)
        self.size = size
        self.memory = raw.data  # memoryview(raw): keeps raw alive; not handed out
        self.start = -raw.ctypes.data % ALIGN_BYTES
        self.lease: Callable[[], np.ndarray | None] = _dead  # free: "no lease is alive"


def pack(arrays: Sequence[np.ndarray], pool: BufferPool) -> tuple[np.ndarray, list[np.ndarray]]:
    """``arrays`` copied back to back into one pooled buffer, each start aligned.

    The padding between them is zero, so one MPI call can reduce the whole
    buffer in place. Returns ``(buffer, views)``: ``buffer`` ends where the
    last array does (the native kernels pack alike: native/kernels/allreduce.cc), and a
    view per array, in its shape, which TensorFlow can adopt as results
    without a copy.
    """
    dtype = arrays[0].dtype
    step = max(1, ALIGN_BYTES // dtype.itemsize)
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.size // step) * step
    buffer = pool.empty(total, dtype)
    views = []
    for a, start, end in zip(arrays, offsets, [*offsets[1:], total]):
        buffer[start : start + a.size] = a.reshape(-1)
        buffer[start + a.size : end] = 0
        views.append(buffer[start : start + a.size].reshape(a.shape))
    return buffer[: offsets[-1] + arrays[-1].size], views
