"""How many dense tensors become few MPI messages: one fused message per dtype,
or per bucket of about ``bytes_per_pack`` bytes.

``fused_allreduce(tensors, allreduce_packed)`` groups the tensors by the dtype
they travel in and reduces each group with one ``allreduce_packed`` call (which
packs the group into one buffer): a sum for the strategy, also a min, max or
product for Horovod's API (``horovod/mpi_ops.py``). float16 and bfloat16 travel and
are reduced as float32 (MPI has no portable half-precision reduction), then
cast back.

With ``bytes_per_pack > 0`` (``CommunicationOptions.bytes_per_pack``) each
group is cut into buckets of about that many bytes, built from the group's
*last* tensor backwards, and each bucket is one ``allreduce_packed`` call,
issued in that order. Gradients come in variable order (first layer first)
and backprop finishes the last layers first, so the first bucket's inputs are
ready first: inside a ``tf.function`` its MPI op can run while TensorFlow is
still differentiating the earlier layers (Horovod's and DDP's overlap). Every
rank builds the same buckets from the same shapes, so every rank issues the
same collectives in the same order. Summing is element-wise, so how the
elements are cut into messages does not change what is summed; the order of
the additions is the MPI library's: at 2 ranks and with MPICH's algorithms the
sums are bit-identical to the unbucketed ones, while Open MPI at 3 or more
ranks picks its algorithm by message size, so a bucketed sum may differ from
the unbucketed one in the last bit (every rank still gets the same bits;
``tests/any_world_size/distribute/test_fusion.py`` checks both).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf

# Dtypes that are reduced in a wider dtype, and the one they are reduced in.
_WIRE_DTYPE = {tf.float16: tf.float32, tf.bfloat16: tf.float32}


def wire_dtype(dtype: tf.DType) -> tf.DType:
    return _WIRE_DTYPE.get(dtype, dtype)


def fused_allreduce(
    tensors: Sequence[tf.Tensor],
    allreduce_packed: Callable[[list[tf.Tensor]], list[tf.Tensor]],
    bytes_per_pack: int | None = 0,
) -> list[tf.Tensor]:
    """Reduces each tensor across ranks with one ``allreduce_packed`` call per
    wire dtype, or per bucket of about ``bytes_per_pack`` bytes.

    Args:
      tensors: a list of dense tensors (any shapes).
      allreduce_packed: reduces a list of tensors of one dtype across ranks in
        one message (``OrderedComm.allreduce_sum_packed``, or
        ``allreduce_packed`` with another op).
      bytes_per_pack: 0 (default): one call per wire dtype. > 0: each wire
        dtype's tensors in buckets (see ``buckets``), last tensors first.

    Returns:
      A list of tensors matching ``tensors`` in order, shape and dtype; on
      every rank the same values, whatever ``bytes_per_pack`` is.
    """
    # wire dtype -> indices; dict keeps first-appearance order, which is the
    # same on every rank.
    groups: dict[tf.DType, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(wire_dtype(t.dtype), []).append(i)

    results: list[tf.Tensor] = [None] * len(tensors)
    for dtype, indices in groups.items():
        sizes = [_nbytes(tensors[i], dtype) for i in indices]
        for bucket in buckets(sizes, bytes_per_pack):
            members = [indices[k] for k in bucket]
            summed = allreduce_packed([tf.cast(tensors[i], dtype) for i in members])
            for i, s in zip(members, summed):
                s = tf.cast(s, tensors[i].dtype)
                s.set_shape(tensors[i].shape)
                results[i] = s
    return results


def buckets(sizes: Sequence[int | None], bytes_per_pack: int | None) -> list[list[int]]:
    """The order and grouping of one dtype's allreduce calls: lists of positions.

    ``sizes``: each tensor's bytes (None if unknown before run time).
    ``bytes_per_pack <= 0``: one bucket of all tensors, in order. Otherwise
    buckets are filled from the last tensor backwards, each closed once it
    holds ``bytes_per_pack`` bytes or more (a tensor is never split; a tensor
    of unknown size closes its own bucket); the buckets come last-tensors
    first, each listing its tensors in their original order. Depends only on
    ``sizes``, so every rank cuts alike.
    """
    if bytes_per_pack is None or bytes_per_pack <= 0 or len(sizes) <= 1:
        return [list(range(len(sizes)))]
    result, current, filled = [], [], 0
    for k in reversed(range(len(sizes))):
        current.append(k)
        size = sizes[k]
        filled = filled + size if size is not None else bytes_per_pack
        if filled >= bytes_per_pack:
            result.append(current[::-1])
            current, filled = [], 0
    if current:
        result.append(current[::-1])
    return result


def _nbytes(tensor: tf.Tensor, dtype: tf.DType) -> int | None:
    """Bytes of ``tensor`` on the wire as ``dtype``, or None if its shape is unknown."""
    elements = tensor.shape.num_elements()
    return None if elements is None else elements * dtype.size
