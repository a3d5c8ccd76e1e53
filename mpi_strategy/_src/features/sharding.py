"""Keras 3 optimizers under ``MPIStrategy(shard="optimizer")`` (ZeRO stage 1).

An optimizer built in the scope of a sharding MPIStrategy of several ranks
partitions the variables it was built with (``distribute/sharding.partition``)
and, through the methods wrapped here (``effects.py`` installs them):

* ``add_variable_from_reference``: makes a variable's slots (momentum, Adam's
  moments, ...) on the rank that owns it, and a ``SlotPlaceholder`` (no data)
  on the others; the EMA copies and gradient accumulators stay whole (every
  rank updates those for every variable: ``_REPLICATED_SLOTS``);
* ``_backend_update_step`` (where Keras 3 sums the gradients over the replicas
  and updates the variables): sums them as before, updates only this rank's
  variables, then all-gathers the updated variables from their owners;
* ``save_own_variables`` / ``load_own_variables`` (``.keras``, ``.weights.h5``,
  Keras' ``BackupAndRestore``): each slot streamed from its owner to the
  writer, one at a time; a load sets the slots this rank holds.

The update is the replicated one, restricted to owned variables: every number
equals the unsharded run's (same sums, same ops). An optimizer with other
per-variable state (Adafactor's factored moments) raises on every rank.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from mpi_strategy._src import _keras_internal
from mpi_strategy._src.core.errors import MPIStrategyError
from mpi_strategy._src.distribute import sharding
from mpi_strategy._src.distribute.ordered_comm import OrderedComm
from mpi_strategy._src.distribute.strategy import MPIStrategy

# Slots every rank keeps whole: Keras updates the EMA copies of all variables
# from the (gathered) weights, and the accumulators sum each rank's own
# unreduced gradients.
_REPLICATED_SLOTS = ("average", "gradient_accumulator")
# Initializers that start a slot alike on every rank with no broadcast.
_CONSTANT_INITIALIZERS = ("Zeros", "Ones", "Constant")
_PLAN = "_mpi_strategy_plan"


@dataclass(frozen=True)
class Plan:
    """Which rank of ``ordered`` owns each variable an optimizer was built with."""

    ordered: OrderedComm
    owner_by_id: dict[int, int]

    def owner(self, variable: Any) -> int | None:
        return self.owner_by_id.get(id(variable))

    @property
    def rank(self) -> int:
        return self.ordered.rank


def plan_of(optimizer: Any) -> Plan | None:
    """The partition of a built optimizer of a sharding MPIStrategy of several
    ranks (made at its first slot, the same on every rank), else None."""
    plan = optimizer.__dict__.get(_PLAN)
    if plan is not None:
        return plan
    strategy = _sharding(optimizer)
    variables = list(getattr(optimizer, _keras_internal.KERAS3_OPTIMIZER_BUILT_WITH, ()))
    if strategy is None or not variables:
        return None
    for method in _keras_internal.KERAS3_SHARDED_UPDATE:
        _keras_internal.check_overridden(method)
    ordered = strategy.extended.ordered_comm
    units = _units(variables)
    owners = sharding.partition(units, ordered.size)
    sharding.check_same_partition(ordered, units, owners)
    plan = Plan(ordered, {id(v): o for v, o in zip(variables, owners)})
    object.__setattr__(optimizer, _PLAN, plan)  # (not a tracked attribute)
    return plan


def _sharding(optimizer: Any) -> MPIStrategy | None:
    """The optimizer's strategy if it is a sharding MPIStrategy of several ranks."""
    strategy = getattr(optimizer, _keras_internal.KERAS3_OPTIMIZER_STRATEGY, None)
    if (
        isinstance(strategy, MPIStrategy)
        and strategy.extended.shard == "optimizer"
        and strategy.extended.comm.Get_size() > 1
    ):
        return strategy
    return None


def _units(variables: Sequence[Any]) -> list[tuple[str, int]]:
    """(name, bytes) of each variable, named by its position in the list the
    optimizer was built with: the same on every rank (the program is; the
    variables' own names need not be, e.g. where rank 0 alone built another
    model first)."""
    return [
        (f"{i:08d}", int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size)
        for i, v in enumerate(variables)
    ]


def add_variable_from_reference_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """Keras 3 ``TFOptimizer.add_variable_from_reference``: the slot itself on
    the rank that owns ``reference_variable``, a placeholder on the others."""

    @functools.wraps(original)
    def add_variable_from_reference(
        self: Any, reference_variable: Any, name: Any = None, initializer: Any = "zeros"
    ) -> Any:
        if name in _REPLICATED_SLOTS:
            slot = original(self, reference_variable, name=name, initializer=initializer)
            if _sharding(self) is not None:
                sharding.mark_replicated(slot)
            return slot
        plan = plan_of(self)
        owner = plan.owner(reference_variable) if plan else None
        if plan is None or owner is None:
            return original(self, reference_variable, name=name, initializer=initializer)
        _check_constant(self, name, initializer)
        if owner == plan.rank:
            with sharding.slots_start_alike():
                slot = original(self, reference_variable, name=name, initializer=initializer)
        else:
            creator = sharding.placeholder_creator(reference_variable.shape, owner)
            with tf.variable_creator_scope(creator):
                slot = original(self, reference_variable, name=name, initializer=initializer)
        sharding.mark_slot(slot, sharding.Held(owner, plan.ordered))
        return slot

    return add_variable_from_reference


def _keras() -> Any:
    """Keras 3 (imported by the program already: these wrappers are installed once it is)."""
    return importlib.import_module("keras")


def _check_constant(optimizer: Any, name: Any, initializer: Any) -> None:
    if type(_keras().initializers.get(initializer)).__name__ not in _CONSTANT_INITIALIZERS:
        raise MPIStrategyError(
            f"mpi_strategy: {type(optimizer).__name__} starts its slot {name!r} with "
            f"{initializer!r}; MPIStrategy(shard='optimizer') shards slots that start at a "
            "constant (each rank makes only its own, with no broadcast)."
        )


def backend_update_step_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """Keras 3 ``TFOptimizer._backend_update_step``: the gradients summed over
    every replica, this rank's variables updated, the others gathered from
    their owners."""

    @functools.wraps(original)
    def _backend_update_step(
        self: Any, grads: Any, trainable_variables: Any, learning_rate: Any
    ) -> Any:
        plan = plan_of(self)
        if plan is None:
            return original(self, grads, trainable_variables, learning_rate)
        _check_all_state_partitioned(self)
        strategy = getattr(self, _keras_internal.KERAS3_OPTIMIZER_STRATEGY)
        owners = [plan.owner(v) for v in trainable_variables]
        variables = [_tf_variable(v) for v in trainable_variables]
        summed = self._all_reduce_sum_gradients(list(zip(grads, variables)))
        owned = [pair for pair, owner in zip(summed, owners) if owner == plan.rank]
        tf.__internal__.distribute.interim.maybe_merge_call(
            self._distributed_tf_update_step, strategy, owned, learning_rate
        )
        tf.__internal__.distribute.interim.maybe_merge_call(
            _assign_from_owners, strategy, plan.ordered, variables, owners
        )

    return _backend_update_step


def _tf_variable(variable: Any) -> Any:
    return variable.value if isinstance(variable, _keras().Variable) else variable


def _assign_from_owners(
    distribution: Any, ordered: OrderedComm, variables: Sequence[Any], owners: Sequence[int]
) -> None:
    for variable, value in zip(variables, sharding.gather_from_owners(ordered, variables, owners)):
        if value is not None:
            distribution.extended.update(variable, _assign, args=(value,), group=False)


def _assign(variable: Any, value: tf.Tensor) -> Any:
    return variable.assign(value)


def _check_all_state_partitioned(optimizer: Any) -> None:
    """Raises on every rank if the optimizer keeps per-variable state made
    otherwise than by ``add_variable_from_reference`` (it would go stale on the
    ranks that do not update the variable). Scalars (the step count, the
    learning rate, Nadam's momentum product) are the optimizer's own: every
    rank updates them alike."""
    unknown = [
        v.path
        for v in optimizer.variables
        if len(v.shape) > 0 and sharding.held(v) is None and not sharding.is_replicated(v)
    ]
    if unknown:
        raise MPIStrategyError(
            f"mpi_strategy: MPIStrategy(shard='optimizer') cannot partition "
            f"{type(optimizer).__name__}: it keeps per-variable state not made by "
            f"add_variable_from_reference ({', '.join(unknown[:3])}). Use it without shard=."
        )


def save_own_variables_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """Keras 3 ``BaseOptimizer.save_own_variables``: every slot as its owner
    holds it, streamed to every rank one at a time (the writer keeps it)."""

    @functools.wraps(original)
    def save_own_variables(self: Any, store: Any) -> Any:
        if plan_of(self) is None:
            return original(self, store)
        for i, variable in enumerate(self.variables):
            held = sharding.held(variable)
            if held is None:
                store[str(i)] = variable.numpy()
                continue
            mine = held.owner == held.ordered.rank
            value = variable.numpy() if mine else np.zeros(variable.shape, variable.dtype)
            store[str(i)] = held.ordered.broadcast(tf.constant(value), root=held.owner).numpy()
        return None

    return save_own_variables


def load_own_variables_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """Keras 3 ``BaseOptimizer.load_own_variables``: sets the slots this rank holds."""

    @functools.wraps(original)
    def load_own_variables(self: Any, store: Any) -> Any:
        if plan_of(self) is None or len(store.keys()) != len(self.variables):
            return original(self, store)  # (Keras warns about a mismatch)
        for i, variable in enumerate(self.variables):
            held = sharding.held(variable)
            if held is None or held.owner == held.ordered.rank:
                variable.assign(store[str(i)])
        return None

    return load_own_variables


def tf_keras_build_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """tf_keras's ``_BaseOptimizer.build``: raises in a sharding MPIStrategy of
    several ranks (its optimizers are not sharded: the program would hold the
    whole state while asking for a share)."""

    @functools.wraps(original)
    def build(self: Any, var_list: Any) -> Any:
        strategy = tf.distribute.get_strategy()
        if (
            isinstance(strategy, MPIStrategy)
            and strategy.extended.shard
            and strategy.extended.comm.Get_size() > 1
        ):
            raise MPIStrategyError(
                f"mpi_strategy: MPIStrategy(shard={strategy.extended.shard!r}) shards Keras 3 "
                f"optimizers; tf_keras's {type(self).__name__} is not sharded yet. Use Keras "
                "3's, or MPIStrategy() without shard=."
            )
        return original(self, var_list)

    return build
