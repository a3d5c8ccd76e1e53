"""Horovod's collectives as TensorFlow ops, with Horovod's gradients.

Each is one or more ordered ops of the process set's ``OrderedComm``
(``distribute/ordered_comm.py``): eager or inside ``tf.function``, every rank gets the
same result, ranks that disagree raise ``MismatchError`` on every rank.
Unlike Horovod, collectives are matched by program order, not by name:
every rank of a process set issues its collectives in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from mpi_strategy._src.distribute import compression, fusion
from mpi_strategy._src.horovod import basics
from mpi_strategy._src.horovod.basics import ProcessSet, global_process_set

# Horovod's reduction ops (the same numbers as Horovod's).
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Sum: "sum", Min: "min", Max: "max", Product: "product"}


def handle_average_backwards_compatibility(op: int | None, average: bool | None) -> int:
    """Horovod's reading of the deprecated ``average=`` argument next to ``op=``."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        return Average if average else Sum
    return Average if op is None else op


def _check_op(op: int) -> None:
    if op == Adasum:
        raise NotImplementedError(
            "mpi_strategy.horovod does not implement the Adasum reduction; use op=hvd.Average "
            "(the default) or op=hvd.Sum."
        )
    if op not in (Average, Sum, Min, Max, Product):
        raise ValueError(f"unknown reduction op {op!r}")


def _scale(tensor: tf.Tensor, factor: float, divisor: int = 1) -> tf.Tensor:
    """``tensor * factor / divisor`` in its dtype, computed as Horovod does:
    integers in float64 (then truncated), half precision in float32. An
    average divides (``x * 3 / 3`` is ``x`` again; ``x * 3 * (1/3)`` may not be)."""
    if factor == 1.0 and divisor == 1:
        return tensor
    dtype, wide = tensor.dtype, fusion.wire_dtype(tensor.dtype)
    if wide != dtype:
        return tf.cast(tf.cast(tensor, wide) * factor / divisor, dtype)
    if dtype.is_floating or dtype.is_complex:
        scaled = tensor * tf.constant(factor, dtype) if factor != 1.0 else tensor
        return scaled / tf.constant(divisor, dtype) if divisor != 1 else scaled
    return tf.cast(tf.cast(tensor, tf.float64) * factor / divisor, dtype)


def _set(process_set: ProcessSet) -> Any:
    basics.check_initialized("a collective")
    return process_set.comm()


def _reduce_dense(
    tensors: Sequence[tf.Tensor],
    op: int,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
) -> list[tf.Tensor]:
    """Reduces dense tensors as the strategy does (``fusion.fused_allreduce``:
    one MPI call per wire dtype), scaled before and after."""
    ordered = _set(process_set)
    name = _OP_NAMES[Sum if op == Average else op]
    inputs = [_scale(tf.convert_to_tensor(t), prescale_factor) for t in tensors]
    reduced: list[tf.Tensor] = [None] * len(inputs)
    groups = _sixteen_bit_groups(inputs, ordered.size) if name == "sum" else {}
    for dtype, members in groups.items():
        summed = compression.sum_in_16_bits([inputs[i] for i in members], ordered, dtype)
        for i, out in zip(members, summed):
            reduced[i] = out
    rest = [i for i, out in enumerate(reduced) if out is None]
    if rest:
        others = fusion.fused_allreduce(
            [inputs[i] for i in rest], lambda xs: ordered.allreduce_packed(xs, name)
        )
        for i, out in zip(rest, others):
            reduced[i] = out
    divisor = process_set.size() if op == Average else 1
    return [_scale(out, postscale_factor, divisor) for out in reduced]


def _sixteen_bit_groups(tensors: Sequence[tf.Tensor], size: int) -> dict[tf.DType, list[int]]:
    """The float16 and bfloat16 tensors of a sum, by dtype: they travel in 16
    bits (``Compression.fp16`` halves the bytes, as in Horovod), summed in
    float32 and rounded once (``compression.sum_in_16_bits``). Not those of
    unknown or empty size, nor on one rank: they are widened to float32."""
    groups: dict[tf.DType, list[int]] = {}
    if size == 1:
        return groups
    for i, t in enumerate(tensors):
        if t.dtype in (tf.float16, tf.bfloat16) and (t.shape.num_elements() or 0) > 0:
            groups.setdefault(t.dtype, []).append(i)
    return groups


def _allreduce(
    tensor: tf.Tensor,
    name: str | None = None,
    op: int = Sum,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor:
    """The dense allreduce op; its gradient is the same allreduce of the gradient."""
    return _grouped_allreduce(
        [tensor], name, op, prescale_factor, postscale_factor, False, process_set
    )[0]


def _grouped_allreduce(
    tensors: Sequence[tf.Tensor],
    name: str | None = None,
    op: int = Sum,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> list[tf.Tensor]:
    """Dense tensors reduced in one call per dtype; gradient: the same reduction."""
    _check_op(op)

    def reduce(*xs: tf.Tensor) -> list[tf.Tensor]:
        return _reduce_dense(xs, op, prescale_factor, postscale_factor, process_set)

    return _with_gradient(reduce, list(tensors), lambda *dys: reduce(*dys))


def _with_gradient(
    forward: Callable[..., list[tf.Tensor]],
    inputs: list[tf.Tensor],
    backward: Callable[..., list[tf.Tensor | None]],
) -> list[tf.Tensor]:
    """``forward(*inputs)``, differentiated by ``backward(*output_gradients)``."""
    inputs = [tf.convert_to_tensor(x) for x in inputs]
    if not any(x.dtype.is_floating or x.dtype.is_complex for x in inputs):
        return forward(*inputs)

    @tf.custom_gradient
    def op(*xs: tf.Tensor) -> Any:
        outs = forward(*xs)

        def grad(*dys: tf.Tensor) -> list[tf.Tensor | None]:
            dys_ = [tf.zeros_like(o) if d is None else d for d, o in zip(dys, outs)]
            return backward(*dys_)

        return outs, grad

    return list(op(*inputs))


def allgather(
    tensor: tf.Tensor,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor:
    """``tensor`` of every rank of the set, concatenated along axis 0 in rank
    order (the first dimension may differ per rank). Gradient: the averaged
    gradient's rows that came from this rank."""
    return grouped_allgather([tensor], name, ignore_name_scope, process_set)[0]


def grouped_allgather(
    tensors: Sequence[tf.Tensor],
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> list[tf.Tensor]:
    """``allgather`` of each of ``tensors``, in one MPI call."""
    inputs = [tf.convert_to_tensor(t) for t in tensors]

    def gather(*xs: tf.Tensor) -> list[tf.Tensor]:
        return _set(process_set).allgather_many(list(xs))

    def backward(*dys: tf.Tensor) -> list[tf.Tensor]:
        grads = [_allreduce(dy, op=Average, process_set=process_set) for dy in dys]
        rows = gather(*[tf.reshape(tf.shape(x, out_type=tf.int64)[0], [1]) for x in inputs])
        me = process_set.rank()
        return [_rows_of(g, r, me) for g, r in zip(grads, rows)]

    return _with_gradient(gather, inputs, backward)


def _rows_of(gathered: tf.Tensor, rows: tf.Tensor, rank: int) -> tf.Tensor:
    """This rank's rows of an all-gathered tensor, given every rank's row count."""
    start = tf.reduce_sum(rows[:rank])
    return gathered[start : start + rows[rank]]


def broadcast(
    tensor: tf.Tensor,
    root_rank: int,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor:
    """``tensor`` as it is on ``root_rank`` (a rank of the set), on every rank.
    Gradient: the averaged gradient on the root, zero elsewhere."""
    _check_root(root_rank, process_set)

    def bcast(x: tf.Tensor) -> list[tf.Tensor]:
        return [_set(process_set).broadcast(x, root_rank)]

    def backward(dy: tf.Tensor) -> list[tf.Tensor]:
        reduced = _allreduce(dy, op=Average, process_set=process_set)
        return [reduced if process_set.rank() == root_rank else reduced * 0]

    return _with_gradient(bcast, [tensor], backward)[0]


def _check_root(root_rank: int, process_set: ProcessSet) -> None:
    basics.check_initialized("broadcast")
    if not 0 <= int(root_rank) < process_set.size():
        raise ValueError(
            f"broadcast: root_rank {root_rank} is not a rank of {process_set} "
            f"(size {process_set.size()})"
        )


def broadcast_(
    variables: Sequence[tf.Variable],
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[tf.Tensor]:
    """Assigns each variable its value on ``root_rank``, in place; returns the new values."""
    _check_root(root_rank, process_set)
    ordered = _set(process_set)
    assigned = [
        variable.assign(ordered.broadcast(tf.convert_to_tensor(variable), root_rank))
        for variable in variables
    ]
    with tf.control_dependencies(assigned):  # (a TensorFlow 1 graph runs them only so)
        return [tf.identity(variable) for variable in variables]


def alltoall(
    tensor: tf.Tensor,
    splits: Any = None,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Sends ``splits[r]`` consecutive rows of ``tensor`` to rank ``r`` (without
    ``splits``: equal parts); returns the rows received, in rank order, and,
    when ``splits`` was given, how many came from each rank (int32).
    Gradient: the same exchange backwards."""
    x = tf.convert_to_tensor(tensor)
    ordered = _set(process_set)
    size = process_set.size()
    if splits is None:
        if x.shape.rank == 0 or (x.shape[0] is not None and x.shape[0] % size):
            raise tf.errors.InvalidArgumentError(
                None,
                None,
                f"alltoall: the first dimension of the tensor ({x.shape}) must be a multiple "
                f"of the number of ranks ({size}) when splits are not given",
            )
        counts = tf.fill([size], tf.shape(x, out_type=tf.int64)[0] // size)
    else:
        counts = tf.cast(tf.convert_to_tensor(splits), tf.int64)
        _check_splits(counts, size)

    def exchange(y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        out, received = ordered.alltoallv(y, counts)
        return out, tf.cast(received, tf.int32)

    if x.dtype.is_floating or x.dtype.is_complex:
        out, received = _alltoall_differentiable(x, exchange, process_set)
    else:
        out, received = exchange(x)
    return (out, received) if splits is not None else out


def _alltoall_differentiable(
    x: tf.Tensor,
    exchange: Callable[[tf.Tensor], tuple[tf.Tensor, tf.Tensor]],
    process_set: ProcessSet,
) -> tuple[tf.Tensor, tf.Tensor]:
    """``exchange(x)``, whose gradient sends the gradient's rows back where they came from."""
    received: list[tf.Tensor] = []

    @tf.custom_gradient
    def op(y: tf.Tensor) -> Any:
        out, counts = exchange(y)
        received.append(counts)

        def grad(dy: tf.Tensor) -> tf.Tensor:
            return alltoall(dy, counts, process_set=process_set)[0]

        return out, grad

    return op(x), received[0]


def _check_splits(counts: tf.Tensor, size: int) -> None:
    """Splits have one entry per rank (what the graph knows; their values are
    checked with every rank's in the collective, so all ranks raise)."""
    if counts.shape.rank != 1 or (counts.shape[0] is not None and counts.shape[0] != size):
        raise tf.errors.InvalidArgumentError(
            None,
            None,
            f"alltoall: splits must have one entry per rank ({size}), got {counts.shape}",
        )


def _reducescatter(
    tensor: tf.Tensor,
    name: str | None = None,
    op: int = Sum,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> tf.Tensor:
    """The reduce-scatter op: this rank's rows (``row_split``) of the reduction.
    Gradient (Horovod's): the gathered gradient, times the set's size for Sum."""
    return _grouped_reducescatter(
        [tensor], name, op, ignore_name_scope, process_set, prescale_factor, postscale_factor
    )[0]


def _grouped_reducescatter(
    tensors: Sequence[tf.Tensor],
    name: str | None = None,
    op: int = Sum,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[tf.Tensor]:
    """``_reducescatter`` of each tensor."""
    _check_op(op)
    if op not in (Sum, Average):
        raise NotImplementedError("reducescatter supports op=hvd.Sum and op=hvd.Average only")
    ordered = _set(process_set)
    size = process_set.size()
    inputs = [tf.convert_to_tensor(t) for t in tensors]
    for x in inputs:
        if x.shape.rank == 0:
            raise ValueError("reducescatter: a scalar cannot be scattered (it needs an axis 0)")
    divisor = size if op == Average else 1

    def scatter(*xs: tf.Tensor) -> list[tf.Tensor]:
        outs = []
        for x in xs:
            y = _scale(x, prescale_factor)
            out = ordered.reducescatter(tf.cast(y, fusion.wire_dtype(y.dtype)), "sum")
            outs.append(_scale(tf.cast(out, x.dtype), postscale_factor, divisor))
        return outs

    def backward(*dys: tf.Tensor) -> list[tf.Tensor]:
        factor = prescale_factor * postscale_factor * (size if op == Sum else 1)
        return [allgather(_scale(dy, factor), process_set=process_set) for dy in dys]

    return _with_gradient(scatter, inputs, backward)


def join() -> tf.Tensor:
    """Waits for every rank of the global set to join; returns the last rank
    that joined (here: the highest rank, since all join at one point).

    Horovod lets joined ranks serve the others' allreduces with zeros; here a
    rank that joins while others are still reducing makes every rank raise
    ``MismatchError`` (naming who joined) instead of hanging.
    """
    ordered = _set(global_process_set)
    ordered.barrier()
    return tf.constant(global_process_set.size() - 1, tf.int32)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Returns once every rank of the set has called it."""
    _set(process_set).barrier()


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The set's size as an int32 scalar tensor."""
    return tf.constant(basics.process_set_by_id(process_set_id).size(), tf.int32)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 if this rank is in the set, else 0 (int32 scalar)."""
    return tf.constant(int(basics.process_set_by_id(process_set_id).included()), tf.int32)


def local_size_op(name: str | None = None) -> tf.Tensor:
    """``local_size()`` as an int32 scalar tensor."""
    return tf.constant(basics.local_size(), tf.int32)


def rank_op(name: str | None = None) -> tf.Tensor:
    """``rank()`` as an int32 scalar tensor."""
    return tf.constant(basics.rank(), tf.int32)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """``local_rank()`` as an int32 scalar tensor."""
    return tf.constant(basics.local_rank(), tf.int32)
