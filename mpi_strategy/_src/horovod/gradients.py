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
