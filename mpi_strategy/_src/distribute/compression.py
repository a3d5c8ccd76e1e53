"""How a fused group of floating-point tensors is summed on the wire: exactly, or in 16 bits.

``MPIStrategy(compression="float16")`` (or ``"bfloat16"``) sends every
float32/float64 tensor of at least ``MIN_BYTES`` (16 KiB) in an all-reduce - in
practice the weight gradients of a step - in half the bytes of float32.
Smaller tensors (losses, metrics, biases) and integers are summed exactly.
``compression=SixteenBit("bfloat16", min_bytes=64 * 1024)`` sets another
threshold.

The compressed sum moves the bytes as MPI's large-message Allreduce does
(reduce-scatter, then allgather: each rank sends and receives 2 (p-1)/p of the
data), in 16-bit values: every rank rounds its values to 16 bits and sends
slice ``r`` to rank ``r`` (one Alltoall); rank ``r`` adds the p pieces of its
slice in float32, in rank order, and rounds the sum to 16 bits once; one
Allgather gives every rank every slice. So each element is rounded twice (the
inputs and the sum, never the partial sums hop by hop; float64 values by way
of float32), and every rank gets bit-identical results. float16 keeps 11
significant bits but a value or sum above 65504 becomes inf (a dynamic loss
scale, as in Keras' mixed precision, backs off from it like from any overflow;
otherwise prefer bfloat16); bfloat16 keeps float32's range with 8 significant bits.

**The policy protocol.** ``compression=`` also takes any object that is a
``CompressionPolicy``:

- ``name``: a non-empty str naming the policy and its settings. The ranks
  compare it when the strategy is built, so it must be the same on every rank
  (and should differ when the settings differ).
- ``allreduce(tensors, mpi, timeout=None)``: ``tensors`` is a list of dense
  tensors of one dtype (any shapes), one fused group of a reduction;
  ``mpi`` is a ``Collectives`` to sum them over (its ``allreduce_sum_packed``,
  ``alltoall`` and ``allgather`` take the same ``timeout``). It returns the sum
  over all ranks of each tensor, in order, with the same shapes and dtype,
  and the same values on every rank. It is called eagerly or while a
  ``tf.function`` is traced, so it must use TensorFlow ops, and every rank
  must issue the same collectives.

The strategy checks the protocol when it is built (``resolve``) and raises a
``TypeError`` (``ValueError`` for an empty name) saying what is wrong.
Subclassing ``Exact`` gives a policy whose ``super().allreduce`` is the exact
sum.
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any, Protocol, runtime_checkable

import tensorflow as tf

MIN_BYTES = 16 * 1024  # default threshold: smaller tensors are summed exactly

_PROTOCOL = "a `name` (str) and an `allreduce(tensors, mpi, timeout=None)` method"


class Collectives(Protocol):
    """The collectives a compression policy receives (as ``mpi``): graph-safe,
    ordered MPI calls over the strategy's ranks, eager or inside
    ``tf.function``; every rank gets the same result. ``timeout``: seconds to
    wait for the other ranks (None: no limit)."""

    @property
    def size(self) -> int:
        """The number of ranks."""

    @property
    def rank(self) -> int:
        """This rank's number, 0 to ``size - 1``."""

    def allreduce_sum_packed(
        self, tensors: list[tf.Tensor], timeout: float | None = None
    ) -> list[tf.Tensor]:
        """The sum over the ranks of each of ``tensors`` (one dtype: float32,
        float64, int32 or int64), in one MPI call."""

    def alltoall(self, x: tf.Tensor, timeout: float | None = None) -> tf.Tensor:
        """Row ``r`` of ``x`` (which has ``size`` rows) goes to rank ``r``; row
        ``r`` of the result came from rank ``r``."""

    def allgather(self, x: tf.Tensor, timeout: float | None = None) -> tf.Tensor:
        """Every rank's ``x`` concatenated along axis 0, in rank order."""


@runtime_checkable
class CompressionPolicy(Protocol):
    """How a fused group of dense tensors is summed over the ranks (see the module)."""

    name: str

    def allreduce(
        self, tensors: list[tf.Tensor], mpi: Collectives, timeout: float | None = None
    ) -> list[tf.Tensor]:
        """The sum over the ranks of each of ``tensors``, in order."""


class Exact:
    """Sums in the tensors' own dtype: one in-place Allreduce of the packed group."""

    name: str = "none"

    def allreduce(
        self, tensors: list[tf.Tensor], mpi: Collectives, timeout: float | None = None
    ) -> list[tf.Tensor]:
        return mpi.allreduce_sum_packed(tensors, timeout)


class SixteenBit(Exact):
    """float32/float64 tensors of at least ``min_bytes`` travel as ``wire_dtype``.

    Args:
      wire_dtype: ``"float16"`` or ``"bfloat16"`` (or the ``tf.DType``).
      min_bytes: smaller tensors (and all tensors of other dtypes) are summed
        exactly. Part of ``name``, so ranks with different thresholds raise
        when the strategy is built.
    """

    def __init__(self, wire_dtype: str | tf.DType, min_bytes: int = MIN_BYTES) -> None:
        self.wire_dtype = tf.as_dtype(wire_dtype)
        if self.wire_dtype not in (tf.float16, tf.bfloat16):
            raise ValueError(
                f"mpi_strategy: SixteenBit's wire_dtype must be float16 or "
                f"bfloat16; got {self.wire_dtype.name}."
            )
        # bool is an int subclass, but True bytes is surely a mistake.
        if not isinstance(min_bytes, numbers.Integral) or isinstance(min_bytes, bool):
            raise TypeError(
                f"mpi_strategy: SixteenBit's min_bytes must be an int; got {min_bytes!r}."
            )
        if min_bytes < 0:
            raise ValueError(f"mpi_strategy: SixteenBit's min_bytes must be >= 0; got {min_bytes}.")
        self.min_bytes: int = int(min_bytes)
        # The default keeps the plain name that logs and error messages show.
        self.name = self.wire_dtype.name + (
            "" if self.min_bytes == MIN_BYTES else f"(min_bytes={self.min_bytes})"
        )

    def allreduce(
        self, tensors: list[tf.Tensor], mpi: Collectives, timeout: float | None = None
    ) -> list[tf.Tensor]:
        dtype = tensors[0].dtype
        if mpi.size == 1 or dtype not in (tf.float32, tf.float64):
            return super().allreduce(tensors, mpi, timeout)
        large = [i for i, t in enumerate(tensors) if self._is_large(t)]
        small = sorted(set(range(len(tensors))) - set(large))
        results: list[tf.Tensor] = [None] * len(tensors)
        if small:
            for i, r in zip(small, super().allreduce([tensors[i] for i in small], mpi, timeout)):
                results[i] = r
        if large:
            for i, r in zip(large, self._allreduce_16([tensors[i] for i in large], mpi, timeout)):
                results[i] = r
        return results

    def _is_large(self, tensor: tf.Tensor) -> bool:
        nbytes = (tensor.shape.num_elements() or 0) * tensor.dtype.size
        # Empty tensors stay exact even at min_bytes=0: nothing to split into slices.
        return nbytes > 0 and nbytes >= self.min_bytes

    def _allreduce_16(
        self, tensors: list[tf.Tensor], mpi: Collectives, timeout: float | None
    ) -> list[tf.Tensor]:
        return sum_in_16_bits(tensors, mpi, self.wire_dtype, timeout)


def sum_in_16_bits(
    tensors: list[tf.Tensor], mpi: Collectives, wire_dtype: tf.DType, timeout: float | None = None
) -> list[tf.Tensor]:
    """The sum over the ranks of each of ``tensors`` (floating point, one
    dtype, any shapes), moved as ``wire_dtype`` (float16 or bfloat16) values:
    an Alltoall of each rank's slices, the slice's sum in float32 in rank
    order, rounded to ``wire_dtype`` once, and an Allgather (see the module).
    The same bits on every rank, in the tensors' dtype and shapes."""
    dtype = tensors[0].dtype
    sizes = [t.shape.num_elements() for t in tensors]
    p, n = mpi.size, sum(sizes)
    chunk = -(-n // p)
    flat = tf.concat([tf.reshape(tf.cast(t, tf.float32), [-1]) for t in tensors], axis=0)
    flat = tf.pad(flat, [[0, chunk * p - n]])
    # Row r: this rank's values of the slice that rank r sums.
    pieces = mpi.alltoall(_to_wire(tf.reshape(flat, [p, chunk]), wire_dtype), timeout)
    my_slice = tf.reduce_sum(_from_wire(pieces, wire_dtype), axis=0)
    summed = mpi.allgather(_to_wire(my_slice[tf.newaxis], wire_dtype), timeout)
    summed = tf.cast(tf.reshape(_from_wire(summed, wire_dtype), [-1])[:n], dtype)
    return [tf.reshape(part, t.shape) for part, t in zip(tf.split(summed, sizes), tensors)]


def _to_wire(values: tf.Tensor, wire_dtype: tf.DType) -> tf.Tensor:
    # Bit patterns as uint16: MPI only moves the bytes.
    return tf.bitcast(tf.cast(values, wire_dtype), tf.uint16)


def _from_wire(bits: tf.Tensor, wire_dtype: tf.DType) -> tf.Tensor:
    return tf.cast(tf.bitcast(bits, wire_dtype), tf.float32)


_BY_NAME: dict[str | None, Any] = {
    None: Exact,
    "none": Exact,
    "float16": lambda: SixteenBit(tf.float16),
    "bfloat16": lambda: SixteenBit(tf.bfloat16),
}


def resolve(compression: str | CompressionPolicy | None) -> CompressionPolicy:
    """The policy for ``compression``: None, "float16", "bfloat16" or a policy object.

    A policy object is checked against the protocol (module docstring) and
    returned as it is. Called by every rank before any MPI call of the
    strategy's construction, so a bad policy raises alike on every rank.
    """
    if compression is None or isinstance(compression, str):
        key = compression.lower() if isinstance(compression, str) else None
        if key in _BY_NAME:
            return _BY_NAME[key]()
        raise ValueError(
            f"mpi_strategy: compression must be None, 'float16' or 'bfloat16' (or a policy "
            f"object with {_PROTOCOL}); got {compression!r}."
        )
    check_policy(compression)
    return compression


def check_policy(policy: Any) -> None:
    """Raises a TypeError or ValueError saying how ``policy`` breaks the protocol."""
    what = f"mpi_strategy: the compression policy {type(policy).__qualname__}"
    allreduce = getattr(policy, "allreduce", None)
    if allreduce is None:
        raise TypeError(f"{what} has no `allreduce` method; a policy needs {_PROTOCOL}.")
    if not callable(allreduce):
        raise TypeError(
            f"{what}: `allreduce` is not callable (a {type(allreduce).__name__}); "
            f"a policy needs {_PROTOCOL}."
        )
    _check_allreduce_parameters(what, allreduce)
    name = getattr(policy, "name", None)
    if not isinstance(name, str):
        raise TypeError(f"{what}: `name` must be a str (the ranks compare it); got {name!r}.")
    if not name:
        raise ValueError(f"{what}: `name` is empty; it names the policy and its settings.")


def _check_allreduce_parameters(what: str, allreduce: Any) -> None:
    try:
        signature = inspect.signature(allreduce)
    except (TypeError, ValueError):  # some builtins have no signature: nothing to check
        return
    # The strategy calls allreduce(tensors, mpi=..., timeout=...).
    try:
        signature.bind(object(), mpi=object(), timeout=None)
    except TypeError as exc:
        raise TypeError(
            f"{what}: `allreduce{signature}` cannot be called as "
            f"allreduce(tensors, mpi=..., timeout=...) ({exc}); a policy needs "
            f"{_PROTOCOL}."
        ) from None
