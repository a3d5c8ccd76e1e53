"""Horovod's ``DistributedOptimizer`` for Keras 3 and tf_keras (and
``PartialDistributedOptimizer``), and which Keras a program uses.

``DistributedOptimizer(opt)`` returns, as Horovod does, an instance of a class
made on the fly: a subclass of ``type(opt)`` with the same name and module,
built from ``opt.get_config()`` (so ``isinstance``, ``get_config`` and saving
see the wrapped optimizer's class; a saved model loads without Horovod). Its
gradients are averaged over the process set, in one fused call
(``gradients.allreduce_gradients``), where every update of that optimizer
passes:

* Keras 3 (``keras.optimizers.Optimizer``): in ``apply(grads,
  trainable_variables)``, which ``apply_gradients`` and ``model.fit``'s train
  step both call;
* tf_keras (``TF_USE_LEGACY_KERAS=1``, or a ``tf_keras`` optimizer, legacy
  ones included): in ``apply_gradients``, which ``minimize`` and tf_keras's
  train step call.

With ``backward_passes_per_step=N`` each call adds its gradients to local
accumulators; every N-th call reduces the accumulated sums (divided by N with
``average_aggregated_gradients``) and applies them, eager or inside
``tf.function`` (every rank counts the same calls, so all take the same
branch). The other calls only advance ``iterations``, as in Horovod.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from mpi_strategy._src.core.logs import logger
from mpi_strategy._src.horovod.basics import ProcessSet, global_process_set
from mpi_strategy._src.horovod.compression import Compression, Compressor
from mpi_strategy._src.horovod.gradients import (
    Groups,
    ReduceGradients,
    _divided,
    allreduce_gradients,
    check_options,
)
from mpi_strategy._src.horovod.mpi_ops import Adasum, Average, Sum

keras: Any = importlib.import_module("keras")

KERAS_PACKAGES = ("keras", "tf_keras")


def keras_package(obj: Any) -> str | None:
    """ "keras" (Keras 3) or "tf_keras": the package whose classes ``obj`` (an
    object or a class) is built from; None if neither."""
    cls = obj if isinstance(obj, type) else type(obj)
    for klass in cls.__mro__:
        root = klass.__module__.partition(".")[0]
        if root in KERAS_PACKAGES:
            return root
    return None


def default_keras_package() -> str:
    """The package ``tf.keras`` is: "tf_keras" under ``TF_USE_LEGACY_KERAS=1``, else "keras"."""
    return keras_package(tf.keras.callbacks.Callback) or "keras"


def keras_module(package: str, name: str = "") -> Any:
    """``package`` (or ``package.name``) imported."""
    return importlib.import_module(f"{package}.{name}" if name else package)


# -- DistributedOptimizer --------------------------------------------------------


class _Options:
    """What a DistributedOptimizer class was made with (shared by its instances)."""

    def __init__(
        self,
        reduce: ReduceGradients,
        name: str,
        process_set: ProcessSet,
        backward_passes_per_step: int,
        average_aggregated_gradients: bool,
        sparse_as_dense: bool,
        scale_local_gradients: bool,
    ) -> None:
        self.reduce = reduce
        self.name = name
        self.process_set = process_set
        self.passes = backward_passes_per_step
        self.average_aggregated = average_aggregated_gradients
        self.sparse_as_dense = sparse_as_dense
        self.scale_local = scale_local_gradients


class _State:
    """One DistributedOptimizer's own state (kept out of Keras' tracking: not
    saved, not among ``optimizer.variables``, as in Horovod)."""

    def __init__(self) -> None:
        self.local: dict[int, Any] = {}  # id -> variable whose gradient stays local
        self.source: Any = None  # the wrapped optimizer, whose state is taken at build
        self.variables: list[Any] | None = None  # what the optimizer was built on
        self.accumulators: list[tf.Variable | None] | None = None
        self.counter: tf.Variable | None = None


class _DistributedMethods:
    """What every DistributedOptimizer class adds to the optimizer's class."""

    _hvd_options: _Options  # set on each made class

    def _hvd(self) -> _State:
        state = self.__dict__.get("_hvd_state")
        if state is None:
            state = self.__dict__["_hvd_state"] = _State()
        return state

    def register_local_var(self, var: Any) -> None:
        """Keeps ``var``'s gradient local (not reduced; divided by the set's
        size with ``scale_local_gradients``), on this rank."""
        self._hvd().local[id(var)] = var

    def _hvd_take_state(self) -> None:
        """Once built: the wrapped optimizer's variable values, if it was built
        on the same variables (same count and shapes), become this one's."""
        state = self._hvd()
        source, state.source = state.source, None
        if source is None:
            return
        mine, theirs = optimizer_variables(self), optimizer_variables(source)
        if len(mine) != len(theirs) or any(
            tuple(a.shape) != tuple(b.shape) for a, b in zip(mine, theirs)
        ):
            return
        with tf.init_scope():
            for a, b in zip(mine, theirs):
                a.assign(tf.convert_to_tensor(b))

    def _hvd_reduce(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        """The gradients averaged over the process set (local ones kept)."""
        options, local = self._hvd_options, self._hvd().local
        shared = [i for i, v in enumerate(variables) if id(v) not in local]
        with tf.name_scope(options.name):
            reduced = options.reduce([grads[i] for i in shared], [variables[i] for i in shared])
        outs = list(grads)
        for i, g in zip(shared, reduced):
            outs[i] = g
        if options.scale_local and local:
            size = float(options.process_set.size())
            for i, v in enumerate(variables):
                if id(v) in local and outs[i] is not None:
                    outs[i] = _divided(outs[i], size)
        return outs

    def _hvd_every_nth(
        self,
        grads: list[Any],
        variables: list[Any],
        apply: Callable[[list[Any]], Any],
        skip: Callable[[], Any],
    ) -> None:
        """Adds ``grads`` to the accumulators; on every N-th call, ``apply``
        (the reduced sums) and resets them; on the others, ``skip()``."""
        options, state = self._hvd_options, self._hvd()
        grads = [_dense(g, options.sparse_as_dense) for g in grads]
        if state.accumulators is None or state.counter is None:
            with tf.init_scope():
                state.counter = tf.Variable(
                    np.int64(0), trainable=False, name="horovod_backward_passes"
                )
                state.accumulators = [
                    None
                    if g is None
                    else tf.Variable(
                        tf.zeros(tuple(v.shape), g.dtype), trainable=False, name="horovod_sum"
                    )
                    for g, v in zip(grads, variables)
                ]
        accumulators, counter = state.accumulators, state.counter
        if len(accumulators) != len(grads) or any(
            (g is None) != (a is None) for g, a in zip(grads, accumulators)
        ):
            raise ValueError(
                "DistributedOptimizer(backward_passes_per_step>1): every call must pass "
                "gradients for the same variables (None for the same ones)"
            )
        sums: list[Any] = []
        for g, a in zip(grads, accumulators):
            if a is None:
                sums.append(None)
            else:
                a.assign_add(g)
                sums.append(a.read_value())
        counter.assign_add(1)

        def reduce_and_apply() -> tf.Tensor:
            reduced = self._hvd_reduce(sums, variables)
            if options.average_aggregated:
                reduced = [None if g is None else g / options.passes for g in reduced]
            apply(reduced)
            for a in accumulators:
                if a is not None:
                    a.assign(tf.zeros_like(a))
            counter.assign(0)
            return tf.constant(True)

        def only_count() -> tf.Tensor:
            skip()
            return tf.constant(False)

        tf.cond(tf.equal(counter, options.passes), reduce_and_apply, only_count)


def _dense(grad: Any, sparse_as_dense: bool) -> Any:
    if isinstance(grad, tf.IndexedSlices):
        if not sparse_as_dense:
            raise ValueError(
                "IndexedSlices are not supported when `backward_passes_per_step` > 1 and "
                "`sparse_as_dense` is False."
            )
        return tf.convert_to_tensor(grad)
    return grad


class CallableList(list[Any]):
    """A list that returns itself when called: ``opt.variables`` and
    ``opt.variables()`` both work on a DistributedOptimizer, as in Horovod."""

    def __call__(self) -> CallableList:
        return self


class _VariablesMethods(_DistributedMethods):
    """Keras 3 and tf_keras: ``variables`` is a property, also callable."""

    @property
    def variables(self) -> CallableList:
        """The optimizer's variables (``opt.variables`` or ``opt.variables()``)."""
        return CallableList(super().variables)  # type: ignore[misc]


class _Keras3Methods(_VariablesMethods):
    """Keras 3: gradients are reduced in ``apply`` (``apply_gradients`` calls it)."""

    def build(self, variables: Any) -> None:
        """Keras' build, then the wrapped optimizer's state (if it was built alike)."""
        super().build(variables)  # type: ignore[misc]
        self._hvd().variables = list(variables)
        self._hvd_take_state()

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        """Applies the gradients averaged over the process set (every rank
        applies the same ones); see the module for backward_passes_per_step."""
        parent_apply = super().apply  # type: ignore[misc]
        grads = list(grads)
        if trainable_variables is not None:
            variables = list(trainable_variables)
        else:
            variables = self._hvd().variables or []
        if not grads or len(variables) != len(grads):
            return parent_apply(grads, trainable_variables)  # (Keras says what is wrong)
        if self._hvd_options.passes == 1:
            return parent_apply(self._hvd_reduce(grads, variables), trainable_variables)
        if not self.built:  # type: ignore[attr-defined]
            with keras.name_scope(self.name, caller=self):  # type: ignore[attr-defined]
                self.build(variables)
        self._hvd_every_nth(
            grads,
            variables,
            lambda reduced: parent_apply(reduced, variables),
            lambda: self.iterations.assign_add(1),  # type: ignore[attr-defined]
        )
        return None


class _ApplyGradientsMethods(_DistributedMethods):
    """tf_keras's optimizers, legacy ones (``OptimizerV2``) as they are:
    gradients are reduced in ``apply_gradients`` (``minimize`` and tf_keras's
    train step call it)."""

    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        """Applies the gradients averaged over the process set (every rank
        applies the same ones); returns what the optimizer's own returns (its
        ``iterations`` with backward_passes_per_step > 1)."""
        parent_apply_gradients = super().apply_gradients  # type: ignore[misc]
        pairs = list(grads_and_vars)
        if not pairs:
            return parent_apply_gradients(pairs, *args, **kwargs)
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        if self._hvd_options.passes == 1:
            reduced = self._hvd_reduce(grads, variables)
            return parent_apply_gradients(list(zip(reduced, variables)), *args, **kwargs)
        self._hvd_build(variables)
        self._hvd_every_nth(
            grads,
            variables,
            lambda reduced: parent_apply_gradients(list(zip(reduced, variables)), *args, **kwargs),
            lambda: self.iterations.assign_add(1),  # type: ignore[attr-defined]
        )
        return self.iterations  # type: ignore[attr-defined]

    def _hvd_build(self, variables: list[Any]) -> None:
        """Nothing: legacy optimizers make their variables in ``apply_gradients``
        (lifted out of any tf.function or tf.cond)."""


class _TFKerasMethods(_ApplyGradientsMethods, _VariablesMethods):
    """tf_keras's (non-legacy) optimizers: built before accumulating, and
    taking the wrapped optimizer's state when built."""

    def build(self, var_list: Any) -> None:
        """tf_keras's build, then the wrapped optimizer's state (if it was built alike)."""
        super().build(var_list)  # type: ignore[misc]
        self._hvd_take_state()

    def _hvd_build(self, variables: list[Any]) -> None:
        with tf.init_scope():
            self.build(variables)


def _optimizer_kind(optimizer: Any) -> type[_DistributedMethods]:
    package = keras_package(optimizer)
    if package == "keras" and isinstance(optimizer, keras.optimizers.Optimizer):
        return _Keras3Methods
    if package == "tf_keras":
        tf_keras = keras_module("tf_keras")
        if isinstance(optimizer, tf_keras.optimizers.legacy.Optimizer):
            return _ApplyGradientsMethods
        if isinstance(optimizer, tf_keras.optimizers.Optimizer):
            return _TFKerasMethods
    raise TypeError(
        "DistributedOptimizer wraps a Keras optimizer (keras.optimizers.Optimizer, or "
        f"tf_keras's, legacy ones included); got {type(optimizer).__module__}."
        f"{type(optimizer).__qualname__}. For a custom training loop, use "
        "hvd.DistributedGradientTape."
    )


def _distributed_class(base: type, methods: type[_DistributedMethods], options: _Options) -> Any:
    """``base`` with ``methods`` first, under ``base``'s own name and module."""
    namespace = {
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__doc__": base.__doc__,
        "_hvd_options": options,
    }
    return type(base.__name__, (methods, base), namespace)


def DistributedOptimizer(
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: int = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Groups = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """``optimizer`` (Keras 3 or tf_keras) whose updates use the gradients
    averaged (``op=Sum``: summed) over ``process_set``: every rank applies the
    same update. A new instance of a subclass of ``type(optimizer)`` with the
    same name, config, and (once built on the same variables) state.

    ``name``: the name scope of the reduction (the optimizer's own name and
    config are kept). ``device_dense``, ``device_sparse``: accepted, unused
    (MPI reduces on the host). ``backward_passes_per_step``,
    ``average_aggregated_gradients``: see the module. Local variables
    (``register_local_var``) keep their own gradients, divided by the set's
    size with ``scale_local_gradients``.
    """
    if op not in (Average, Sum):
        raise ValueError("op currently only supports Average and Sum")
    groups = check_options(gradient_predivide_factor, op, num_groups, groups)
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be > 0")
    methods = _optimizer_kind(optimizer)
    if backward_passes_per_step > 1 and getattr(optimizer, "gradient_accumulation_steps", None):
        raise ValueError(
            "DistributedOptimizer: backward_passes_per_step and the optimizer's own "
            "gradient_accumulation_steps both accumulate gradients; use one of them"
        )
    base = type(optimizer)
    options = _Options(
        allreduce_gradients(
            compression, sparse_as_dense, op, gradient_predivide_factor, groups, process_set
        ),
        name or f"Distributed{base.__name__}",
        process_set,
        backward_passes_per_step,
        average_aggregated_gradients,
        sparse_as_dense,
        scale_local_gradients,
    )
    distributed = _distributed_class(base, methods, options).from_config(optimizer.get_config())
    state = distributed._hvd()
    state.source = optimizer
    if methods is _ApplyGradientsMethods:
        _copy_legacy_state(distributed, optimizer)
    return distributed


def _copy_legacy_state(distributed: Any, optimizer: Any) -> None:
    """A legacy tf_keras optimizer makes its slots at its first update, so the
    new one cannot take them over: its ``iterations`` only (Horovod keeps none)."""
    distributed._hvd().source = None
    iterations = int(optimizer.iterations.numpy())
    if iterations:
        distributed.iterations.assign(iterations)
        logger.warning(
            "DistributedOptimizer: the slot variables (if any) of the tf_keras legacy "
            "optimizer %s, which already made %d updates, are not carried over; wrap it "
            "before training.",
            optimizer.get_config().get("name"),
            iterations,
        )


def PartialDistributedOptimizer(
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: int = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    groups: Groups = None,
    process_set: ProcessSet = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> Any:
    """``DistributedOptimizer`` whose ``local_layers`` (a layer or a list)
    keep their trainable weights' gradients local to each rank."""
    layers = [] if local_layers is None else local_layers
    if not isinstance(layers, (list, tuple)):
        layers = [layers]
    for layer in layers:
        if keras_package(layer) is None or not hasattr(layer, "trainable_weights"):
            raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    distributed = DistributedOptimizer(
        optimizer,
        name,
        device_dense,
        device_sparse,
        compression,
        sparse_as_dense,
        gradient_predivide_factor,
        op,
        backward_passes_per_step,
        average_aggregated_gradients,
        0,
        groups,
        process_set,
        scale_local_gradients,
    )
    for layer in layers:
        for weight in layer.trainable_weights:
            distributed.register_local_var(weight)
    return distributed


def tensorflow_distributed_optimizer(
    optimizer: Any,
    name: str | None = None,
    use_locking: bool = False,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Groups = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """``horovod.tensorflow.DistributedOptimizer`` (its argument order): a
    Keras optimizer (Keras 3 or tf_keras) wrapped by the Keras
    ``DistributedOptimizer`` (every rank applies the same averaged update).
    TensorFlow 1's ``tf.compat.v1.train.Optimizer`` is not supported."""
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise NotImplementedError(
            "mpi_strategy.horovod does not wrap TensorFlow 1 optimizers "
            "(tf.compat.v1.train.Optimizer); use a Keras optimizer, or "
            "hvd.DistributedGradientTape and the optimizer's apply_gradients."
        )
    if op == Adasum:
        raise ValueError("op == Adasum is not supported yet with Keras")
    return DistributedOptimizer(
        optimizer,
        name=name,
        device_dense=device_dense,
        device_sparse=device_sparse,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor,
        op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        num_groups=num_groups,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )


def optimizer_variables(optimizer: Any) -> list[Any]:
    """An optimizer's variables (a property in Keras 3 and tf_keras, a method
    in tf_keras's legacy optimizers)."""
    found = optimizer.variables
    return list(found() if callable(found) else found)
