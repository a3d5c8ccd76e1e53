"""Horovod's allreduce and reducescatter, with ``tf.IndexedSlices`` and compression."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from mpi_strategy._src.horovod.basics import ProcessSet, global_process_set
from mpi_strategy._src.horovod.compression import Compression, Compressor
from mpi_strategy._src.horovod.mpi_ops import (
    Adasum,
    Average,
    Sum,
    _grouped_allreduce,
    _grouped_reducescatter,
    grouped_allgather,
    handle_average_backwards_compatibility,
)

Tensorish = Any  # a tf.Tensor, tf.Variable or tf.IndexedSlices


def allreduce(
    tensor: Tensorish,
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
) -> Tensorish:
    """``tensor`` reduced over the ranks of ``process_set`` (default op:
    Average); the same on every rank. A ``tf.IndexedSlices`` is all-gathered
    (values and indices), as in Horovod."""
    return grouped_allreduce(
        [tensor],
        average,
        device_dense,
        device_sparse,
        compression,
        op,
        prescale_factor,
        postscale_factor,
        process_set,
        ignore_name_scope,
        name,
    )[0]


def grouped_allreduce(
    tensors: Sequence[Tensorish],
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    name: str | None = None,
) -> list[Tensorish]:
    """``allreduce`` of each of ``tensors``: the dense ones in one MPI call
    per dtype, the ``tf.IndexedSlices`` in one all-gather."""
    if not tensors:
        return list(tensors)
    op = handle_average_backwards_compatibility(op, average)
    outs: list[Tensorish] = [None] * len(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    if sparse:
        reduced = _reduce_sparse(
            [tensors[i] for i in sparse], op, prescale_factor, postscale_factor, process_set
        )
        for i, out in zip(sparse, reduced):
            outs[i] = out
    if dense:
        compressed, contexts = zip(*[compression.compress(tensors[i]) for i in dense])
        reduced = _grouped_allreduce(
            list(compressed), name, op, prescale_factor, postscale_factor, False, process_set
        )
        for i, out, ctx in zip(dense, reduced, contexts):
            outs[i] = compression.decompress(out, ctx)
    return outs


def _reduce_sparse(
    slices: list[tf.IndexedSlices],
    op: int,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
) -> list[tf.IndexedSlices]:
    if op == Adasum:
        raise NotImplementedError(
            "The Adasum reduction does not support sparse tensors (and is not implemented "
            "by mpi_strategy.horovod)."
        )
    if op not in (Sum, Average):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
    values = grouped_allgather([s.values for s in slices], process_set=process_set)
    indices = grouped_allgather([s.indices for s in slices], process_set=process_set)
    size = process_set.size()
    return [
        tf.IndexedSlices(v / tf.cast(size, v.dtype) if op == Average else v, i, s.dense_shape)
        for v, i, s in zip(values, indices, slices)
    ]


def reducescatter(
    tensor: Tensorish,
    device_dense: str = "",
    compression: type[Compressor] = Compression.none,
    op: int = Average,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> tf.Tensor:
    """``tensor`` (one shape on every rank) reduced over the set, of which
    this rank keeps its rows: ``len // size`` rows, one more on the first
    ``len % size`` ranks."""
    return grouped_reducescatter(
        [tensor],
        device_dense,
        compression,
        op,
        process_set,
        ignore_name_scope,
        prescale_factor,
        postscale_factor,
    )[0]


def grouped_reducescatter(
    tensors: Sequence[Tensorish],
    device_dense: str = "",
    compression: type[Compressor] = Compression.none,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[tf.Tensor]:
    """``reducescatter`` of each of ``tensors``."""
    compressed, contexts = zip(*[compression.compress(tf.convert_to_tensor(t)) for t in tensors])
    outs = _grouped_reducescatter(
        list(compressed),
        None,
        op,
        ignore_name_scope,
        process_set,
        prescale_factor,
        postscale_factor,
    )
    return [compression.decompress(out, ctx) for out, ctx in zip(outs, contexts)]
