"""Horovod's gradient averaging: ``DistributedGradientTape`` and the
``allreduce_gradients`` that it and ``DistributedOptimizer`` share."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from mpi_strategy._src.horovod.api import grouped_allreduce
from mpi_strategy._src.horovod.basics import ProcessSet, global_process_set
from mpi_strategy._src.horovod.compression import Compression, Compressor
from mpi_strategy._src.horovod.mpi_ops import Average

Groups = int | Sequence[Sequence[tf.Variable]] | None
ReduceGradients = Callable[[list[Any], list[Any]], list[Any]]


def check_options(
    gradient_predivide_factor: float, op: int, num_groups: int, groups: Groups
) -> Groups:
    """Horovod's argument checks; returns the groups to use."""
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups:
        warnings.warn(
            "Parameter `num_groups` has been replaced by `groups`.",
            DeprecationWarning,
            stacklevel=3,
        )
        groups = groups if groups is not None else num_groups
    if groups is not None and not (isinstance(groups, list) or int(groups) > 0):  # type: ignore[arg-type]
        raise ValueError(
            "groups should be a non-negative integer or a list of list of tf.Variable."
        )
    return groups


def allreduce_gradients(
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    groups: Groups = None,
    process_set: ProcessSet = global_process_set,
) -> ReduceGradients:
    """A function ``(grads, variables) -> reduced grads`` (None stays None).

    Every gradient is reduced in one grouped call (one MPI call per dtype);
    ``groups`` (a number, or lists of variables) splits them into that many
    calls, as in Horovod. ``gradient_predivide_factor`` f: scale by 1/f before
    the sum and f/size after.
    """
    prescale = 1.0 / gradient_predivide_factor if op == Average else 1.0
    postscale = gradient_predivide_factor if op == Average else 1.0

    def reduce(grads: list[Any], variables: list[Any]) -> list[Any]:
        if sparse_as_dense:
            grads = [
                tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads
            ]
        if process_set.size() == 1 or not process_set.included():
            return list(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        outs = list(grads)
        for group in _split(present, grads, variables, groups):
            reduced = grouped_allreduce(
                [grads[i] for i in group],
                compression=compression,
                op=op,
                prescale_factor=prescale,
                postscale_factor=postscale,
                process_set=process_set,
            )
            for i, g in zip(group, reduced):
                outs[i] = g
        return outs

    return reduce


class GradientAggregationHelper:
    """Horovod's ``LocalGradientAggregationHelper``, a DistributedOptimizer's
    ``_agg_helper`` with ``backward_passes_per_step`` N > 1: gradients are
    summed locally over N backward passes and reduced once, every N-th pass.

    ``compute_gradients`` adds a pass's gradients to the sums and counts it
    (``counter``); at the N-th pass it returns the sums reduced (divided by N
    with ``average_aggregated_gradients``), sets the sums to zero (assigned,
    so an inf gradient of one cycle leaves nothing behind) and the counter to
    0; at the other passes, the local sums. ``apply_gradients`` applies when
    the counter is 0 (a reduction just happened), else only counts the step in
    the optimizer's ``iterations``. Every rank counts the same passes, so all
    take the same branch and meet in the same reductions, eager or traced.
    """

    def __init__(
        self,
        backward_passes_per_step: int,
        reduce: ReduceGradients,
        sparse_as_dense: bool,
        average_aggregated_gradients: bool,
    ) -> None:
        if backward_passes_per_step <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self.backward_passes_per_step = backward_passes_per_step
        self.average_aggregated_gradients = average_aggregated_gradients
        self.sparse_as_dense = sparse_as_dense
        self._reduce = reduce
        with tf.init_scope():  # (made eagerly even if the optimizer is made in a graph)
            self.counter = tf.Variable(0, trainable=False, name="horovod_backward_passes")
        self.locally_aggregated_grads: dict[int, tf.Variable] = {}

    def compute_gradients(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        """This pass's gradients added to the local sums; the reduced sums at
        every N-th pass, else the local sums (None stays None)."""
        grads = [self._dense(g) for g in grads]
        sums = self._accumulate(grads, variables)
        self.counter.assign_add(1)

        present = [i for i, g in enumerate(sums) if g is not None]

        def reduce_and_clear() -> list[Any]:
            reduced = self._reduce(sums, list(variables))
            if self.average_aggregated_gradients:
                reduced = [
                    None if g is None else g / self.backward_passes_per_step for g in reduced
                ]
            self._clear()
            # (a flag last: a traced cond needs an output even with no gradients)
            return [reduced[i] for i in present] + [tf.constant(True)]

        def local_sums() -> list[Any]:
            return [sums[i] for i in present] + [tf.constant(False)]

        outs = tf.cond(
            tf.equal(self.counter, self.backward_passes_per_step), reduce_and_clear, local_sums
        )
        result: list[Any] = [None] * len(sums)
        for i, g in zip(present, outs):
            result[i] = g
        return result

    def apply_gradients(self, apply: Callable[[], Any], optimizer: Any) -> Any:
        """``apply()`` when the counter is 0 (a reduction just happened); else
        the optimizer's ``iterations`` + 1. Returns ``iterations``."""

        def applied() -> tf.Tensor:
            apply()
            return tf.constant(True)

        def counted() -> tf.Tensor:
            optimizer.iterations.assign_add(1)
            return tf.constant(False)

        tf.cond(tf.equal(self.counter, 0), applied, counted)
        return optimizer.iterations

    def _dense(self, grad: Any) -> Any:
        if isinstance(grad, tf.IndexedSlices):
            if not self.sparse_as_dense:
                raise ValueError(
                    "IndexedSlices are not supported when `backward_passes_per_step` > 1 and "
                    "`sparse_as_dense` is False."
                )
            return tf.convert_to_tensor(grad)
        return grad

    def _accumulate(self, grads: list[Any], variables: Sequence[Any]) -> list[Any]:
        """The local sums after adding ``grads`` (made at the first pass)."""
        sums = self.locally_aggregated_grads
        if not sums:
            with tf.init_scope():  # (lifted out of tf.function and tf.cond)
                for i, (g, v) in enumerate(zip(grads, variables)):
                    if g is not None:
                        zeros = tf.zeros(tuple(v.shape), g.dtype)
                        sums[i] = tf.Variable(zeros, trainable=False, name="horovod_sum")
        if len(grads) != len(variables) or sorted(sums) != [
            i for i, g in enumerate(grads) if g is not None
        ]:
            raise ValueError(
                "DistributedOptimizer(backward_passes_per_step > 1): every backward pass "
                f"must give gradients for the same variables (None for the same ones); the "
                f"first gave {len(sums)} gradients, this one "
                f"{sum(g is not None for g in grads)} of {len(grads)}"
            )
        outs: list[Any] = []
        for i, g in enumerate(grads):
            if g is None:
                outs.append(None)
            else:
                sums[i].assign_add(g)
                outs.append(sums[i].read_value())
        return outs

    def _clear(self) -> None:
        self.counter.assign(0)
        for total in self.locally_aggregated_grads.values():
            total.assign(tf.zeros_like(total))


def _split(
    present: list[int], grads: list[Any], variables: list[Any], groups: Groups
) -> list[list[int]]:
    if not present:
        return []
    if groups is None:
        return [present]
    if isinstance(groups, int):
        n = min(groups, len(present))
        return [present[k::n] for k in range(n)] if n else [present]
    slot = {id(v): i for i, v in enumerate(variables)}
    split, seen = [], set()
    for group in groups:
        members = [slot[id(v)] for v in group if id(v) in slot and slot[id(v)] in present]
        seen.update(members)
        if members:
            split.append(members)
    return split + [[i] for i in present if i not in seen]


# Called inside tf.function, the tape's methods run as written (AutoGraph
# would convert them, and the library's Python beneath).
_not_converted = tf.autograph.experimental.do_not_convert


class DistributedGradientTape:
    """A ``tf.GradientTape`` whose ``gradient`` averages the gradients over the
    process set (every rank gets the same gradients); everything else is the
    wrapped tape's. Sources registered as local (``register_local_source``)
    keep their own gradient, divided by the set's size (Horovod's
    ``scale_local_gradients``)."""

    def __init__(
        self,
        gradtape: tf.GradientTape,
        device_dense: str = "",
        device_sparse: str = "",
        compression: type[Compressor] = Compression.none,
        sparse_as_dense: bool = False,
        op: int = Average,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: Groups = None,
        process_set: ProcessSet = global_process_set,
        scale_local_gradients: bool = True,
    ) -> None:
        groups = check_options(gradient_predivide_factor, op, num_groups, groups)
        self._wrapped = gradtape
        self._reduce = allreduce_gradients(
            compression, sparse_as_dense, op, gradient_predivide_factor, groups, process_set
        )
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._local_sources: set[Any] = set()

    @_not_converted
    def __enter__(self) -> DistributedGradientTape:
        self._wrapped.__enter__()
        return self

    @_not_converted
    def __exit__(self, *exc: Any) -> None:
        self._wrapped.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)

    @_not_converted
    def register_local_source(self, source: tf.Variable) -> None:
        """Keeps ``source``'s gradient local (not reduced)."""
        self._local_sources.add(_key(source))

    @_not_converted
    def gradient(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        unconnected_gradients: Any = tf.UnconnectedGradients.NONE,
        use_generic_names: bool = False,
    ) -> Any:
        """The wrapped tape's gradients, averaged over the process set."""
        grads = self._wrapped.gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources, flat_grads = tf.nest.flatten(sources), tf.nest.flatten(grads)
        shared = [i for i, s in enumerate(flat_sources) if not self._is_local(s)]
        reduced = self._reduce([flat_grads[i] for i in shared], [flat_sources[i] for i in shared])
        outs = list(flat_grads)
        for i, g in zip(shared, reduced):
            outs[i] = g
        if self.scale_local_gradients and self._local_sources:
            size = float(self.process_set.size())
            for i, s in enumerate(flat_sources):
                if self._is_local(s) and outs[i] is not None:
                    outs[i] = _divided(outs[i], size)
        return tf.nest.pack_sequence_as(grads, outs)

    @_not_converted
    def get_local_and_global_gradients(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        use_generic_names: bool = False,
    ) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
        """(local (source, gradient) pairs, reduced (source, gradient) pairs)."""
        grads = self.gradient(target, sources, output_gradients)
        pairs = list(zip(tf.nest.flatten(sources), tf.nest.flatten(grads)))
        return (
            [p for p in pairs if self._is_local(p[0])],
            [p for p in pairs if not self._is_local(p[0])],
        )

    def _is_local(self, source: Any) -> bool:
        return _key(source) in self._local_sources


def _key(source: Any) -> Any:
    """A hashable key for a variable: TF's ``ref()``; a Keras 3 variable has none."""
    return source.ref() if hasattr(source, "ref") else id(source)


def _divided(grad: Any, size: float) -> Any:
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / size, grad.indices, grad.dense_shape)
    return grad / size


def PartialDistributedGradientTape(
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Groups = None,
    process_set: ProcessSet = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> DistributedGradientTape:
    """A ``DistributedGradientTape`` whose ``local_layers``' trainable
    weights keep their local gradients."""
    tape = DistributedGradientTape(
        gradtape,
        device_dense,
        device_sparse,
        compression,
        sparse_as_dense,
        op,
        gradient_predivide_factor,
        num_groups,
        groups,
        process_set,
        scale_local_gradients,
    )
    layers = [] if local_layers is None else local_layers
    for layer in layers if isinstance(layers, (list, tuple)) else [layers]:
        for weight in layer.trainable_weights:
            tape.register_local_source(weight)
    return tape


__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape"]
