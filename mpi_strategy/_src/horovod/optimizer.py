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
  ones included): Horovod's Keras 2 hooks. ``_compute_gradients`` /
  ``compute_gradients`` / ``get_gradients`` (which ``minimize``, and so
  tf_keras's train step, call) reduce, through Horovod's ``_allreduce``, and
  ``apply_gradients`` applies what they returned; given gradients of its own
  (a ``tf.GradientTape``'s), ``apply_gradients`` reduces them first.

With ``backward_passes_per_step=N`` the optimizer's ``_agg_helper``
(``gradients.GradientAggregationHelper``, Horovod's) adds each pass's
gradients to local sums; every N-th pass reduces the sums (divided by N with
``average_aggregated_gradients``) and applies them, eager or inside
``tf.function`` (every rank counts the same passes, so all take the same
branch). The other passes only advance ``iterations``, as in Horovod.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from mpi_strategy._src import _keras_internal
from mpi_strategy._src.core.logs import logger
from mpi_strategy._src.horovod.basics import ProcessSet, global_process_set
from mpi_strategy._src.horovod.compression import Compression, Compressor
from mpi_strategy._src.horovod.gradients import (
    GradientAggregationHelper,
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
        # Set while gradients that _allreduce returned wait for apply_gradients.
        self.reduced_pending = False


class _DistributedMethods:
    """What every DistributedOptimizer class adds to the optimizer's class."""

    _hvd_options: _Options  # set on each made class

    def _hvd(self) -> _State:
        state = self.__dict__.get("_hvd_state")
        if state is None:
            state = self.__dict__["_hvd_state"] = _State()
        return state

    @property
    def _agg_helper(self) -> GradientAggregationHelper | None:
        """Horovod's gradient aggregation state with backward_passes_per_step
        > 1 (its ``counter`` of the passes since the last reduction), else None."""
        options = self._hvd_options
        if options.passes == 1:
            return None
        helper = self.__dict__.get("_hvd_agg_helper")
        if helper is None:
            helper = self.__dict__["_hvd_agg_helper"] = GradientAggregationHelper(
                options.passes,
                self._hvd_reduce,
                options.sparse_as_dense,
                options.average_aggregated,
            )
        return helper

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

    def _allreduce(self, grads: Any, variables: Any) -> list[Any]:
        """Horovod's: the gradients reduced over the process set (local ones
        kept); with backward_passes_per_step > 1, ``_agg_helper``'s
        (accumulated, reduced at every N-th pass). ``apply_gradients`` applies
        what this returns without reducing it again."""
        grads, variables = list(grads), list(variables)
        self._hvd().reduced_pending = True
        helper = self._agg_helper
        if helper is not None:
            return helper.compute_gradients(grads, variables)
        return self._hvd_reduce(grads, variables)

    def _hvd_apply(
        self, grads: list[Any], variables: list[Any], apply: Callable[[list[Any]], Any]
    ) -> Any:
        """``apply(grads)``: the gradients reduced here unless ``_allreduce``
        made them (then as they are, as in Horovod), every N-th pass only."""
        state = self._hvd()
        if not state.reduced_pending:
            grads = self._allreduce(grads, variables)
        state.reduced_pending = False
        helper = self._agg_helper
        if helper is None:
            return apply(grads)
        self._hvd_build(variables)
        return helper.apply_gradients(lambda: apply(grads), self)

    def _hvd_build(self, variables: list[Any]) -> None:
        """Builds the optimizer outside the apply/skip cond (variables cannot
        be made in a branch); nothing where ``apply_gradients`` lifts its own
        variable creation out (tf_keras's legacy optimizers)."""


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
    """Keras 3: gradients are reduced in ``apply`` (``apply_gradients`` and
    ``fit``'s train step call it)."""

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
        applied = self._hvd_apply(grads, variables, lambda g: parent_apply(g, variables))
        return None if self._agg_helper is not None else applied

    def _hvd_build(self, variables: list[Any]) -> None:
        if not self.built:  # type: ignore[attr-defined]
            with keras.name_scope(self.name, caller=self):  # type: ignore[attr-defined]
                self.build(variables)


class _ApplyGradientsMethods(_DistributedMethods):
    """tf_keras's optimizers, legacy ones (``OptimizerV2``) as they are:
    Horovod's Keras 2 hooks. ``minimize`` (and so tf_keras's train step)
    reduces in ``_compute_gradients`` / ``compute_gradients`` and applies
    those gradients; ``apply_gradients`` given other gradients (a
    ``tf.GradientTape``'s) reduces them itself."""

    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        """Applies the gradients averaged over the process set (every rank
        applies the same ones); returns what the optimizer's own returns (its
        ``iterations`` with backward_passes_per_step > 1)."""
        parent_apply_gradients = super().apply_gradients  # type: ignore[misc]
        pairs = list(grads_and_vars)
        if not pairs:
            return parent_apply_gradients(pairs, *args, **kwargs)
        variables = [v for _, v in pairs]
        return self._hvd_apply(
            [g for g, _ in pairs],
            variables,
            lambda grads: parent_apply_gradients(list(zip(grads, variables)), *args, **kwargs),
        )

    def compute_gradients(self, loss: Any, var_list: Any, tape: Any = None) -> list[Any]:
        """(gradient, variable) pairs of ``loss``, reduced (``_compute_gradients``)."""
        return self._compute_gradients(loss, var_list, None, tape)

    def _compute_gradients(
        self, loss: Any, var_list: Any, grad_loss: Any = None, tape: Any = None
    ) -> list[Any]:
        """The optimizer's own (gradient, variable) pairs, the gradients
        passed through ``_allreduce``; ``apply_gradients`` applies them as they
        are. Legacy optimizers' ``minimize`` calls this (listed in
        ``_keras_internal.TF_KERAS_LEGACY_COMPUTE_GRADIENTS``)."""
        base: Any = super()
        tape = tf.GradientTape() if tape is None else tape
        if hasattr(base, "_compute_gradients"):
            pairs = base._compute_gradients(loss, var_list, grad_loss, tape=tape)
        else:
            pairs = base.compute_gradients(loss, var_list, tape=tape)
        grads, variables = zip(*pairs)
        return list(zip(self._allreduce(grads, variables), variables))

    def get_gradients(self, loss: Any, params: Any) -> list[Any]:
        """The optimizer's own ``get_gradients`` (graph mode), through ``_allreduce``."""
        return self._allreduce(super().get_gradients(loss, params), params)  # type: ignore[misc]

    def _aggregate_gradients(self, grads_and_vars: Any) -> Any:
        """The optimizer's own aggregation over a strategy's replicas (none
        here: each rank is one replica; the ranks' reduction is ``_allreduce``)."""
        base: Any = super()
        if hasattr(base, "_aggregate_gradients"):
            return base._aggregate_gradients(grads_and_vars)
        return base.aggregate_gradients(grads_and_vars)


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
            _keras_internal.check_overridden(_keras_internal.TF_KERAS_LEGACY_COMPUTE_GRADIENTS)
            _keras_internal.check_overridden(_keras_internal.TF_KERAS_LEGACY_AGGREGATE_GRADIENTS)
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
