"""Keras 3's and tf_keras's optimizers under ``MPIStrategy(shard="optimizer")``
(ZeRO stage 1) and ``shard="gradients"`` (stage 2).

An optimizer built in the scope of a sharding MPIStrategy of several ranks
partitions the variables it was built with (``distribute/sharding.partition``)
and, through the methods wrapped here (``effects.py`` installs them):

* ``add_variable_from_reference``: makes a variable's slots (momentum, Adam's
  moments, ...) on the rank that owns it, and a ``SlotPlaceholder`` (no data)
  on the others; the EMA copies and gradient accumulators stay whole (every
  rank updates those for every variable: ``_REPLICATED_SLOTS``);
* ``add_variable``: makes Adafactor's factored moments of a variable (its
  row and column means) as its slots, on the rank that holds the variable
  (held whole: ``NEVER_CUT``);
* ``_backend_update_step`` (where Keras 3 sums the gradients over the replicas
  and updates the variables): sums them as before (stage 2: only this rank's
  share of them, by a reduce-scatter), updates only this rank's variables,
  then all-gathers the updated variables from their owners;
* ``save_own_variables`` / ``load_own_variables`` (``.keras``, ``.weights.h5``,
  Keras' ``BackupAndRestore``): each slot gathered whole on every rank from
  the ranks that hold it, one at a time; a load sets what this rank holds.

tf_keras's optimizers (``TF_KERAS_SUPPORTED``) use the same plan, slots and
all-gather: ``_BaseOptimizer.build`` makes the plan,
``Optimizer.add_variable_from_reference`` each rank's slots, and
``Optimizer._distributed_apply_gradients_fn`` (given the gradients tf_keras
summed and clipped) updates this rank's share, gathers the rest, then runs the
original for its EMA and step count, with ``_update_step`` a no-op; its
``add_variable``, ``save_own_variables`` / ``load_own_variables`` are wrapped
as Keras 3's.
Stage 2: ``Optimizer.aggregate_gradients`` reduce-scatters instead of
summing, ``_clip_gradients`` lets the shares pass, and the step clips them
(``_clip_shares``: the norms summed over the ranks) before it updates.

The update is the replicated one, restricted to this rank's share: every number
equals the unsharded run's (same sums, same ops; stage 2's reduce-scatter may
add three or more ranks' gradients in another order than the all-reduce).
Other optimizers than ``SUPPORTED`` raise on every rank; an optimizer that
makes no slot (SGD without momentum) is not sharded (all-reduced as usual).
"""

from __future__ import annotations

import functools
import importlib
import itertools
import json
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from mpi_strategy._src import _keras_internal, _tf_internal
from mpi_strategy._src.core.errors import MPIStrategyError
from mpi_strategy._src.distribute import cross_device_ops, sharding
from mpi_strategy._src.distribute.ordered_comm import OrderedComm
from mpi_strategy._src.distribute.strategy import MPIStrategy
from mpi_strategy._src.features.saving import write_point

# Slots every rank keeps whole: Keras updates the EMA copies of all variables
# from the (gathered) weights, and the accumulators sum each rank's own
# unreduced gradients.
_REPLICATED_SLOTS = ("average", "gradient_accumulator")
# Initializers that start a slot alike on every rank with no broadcast.
_CONSTANT_INITIALIZERS = ("Zeros", "Ones", "Constant")
_PLAN = "_mpi_strategy_plan"
# Set on a tf_keras optimizer while its original step runs after this rank's updates.
_UPDATED = "_mpi_strategy_updated"


@dataclass(frozen=True)
class Plan:
    """How the variables an optimizer was built with are cut over the ranks of
    ``ordered`` (``pieces``, by position), and this rank's shadows: a variable
    for each of its pieces that is not a whole variable (the optimizer updates
    those rows there, with slots of their shape)."""

    ordered: OrderedComm
    variables: tuple[Any, ...]  # those it was built with
    index_by_id: dict[int, int]
    pieces: tuple[tuple[sharding.Piece, ...], ...]
    shadows: dict[int, Any]
    kind: _Kind  # which Keras's optimizer it is
    # For an optimizer whose update advances state outside its slots (tf_keras's
    # Nadam): a variable of no rows for each variable this rank holds none of,
    # which its update runs on (``_update_held``), in the order of the step.
    ghosts: dict[int, Any]
    # For an optimizer of FACTORED_MOMENTS: the (position, shape) of each
    # factored moment its build is yet to make by add_variable, in order.
    factored: deque[tuple[int, tuple[int, ...]]]

    def index(self, variable: Any) -> int | None:
        """The variable's position in the list the optimizer was built with."""
        return self.index_by_id.get(id(variable))

    def position(self, variable: Any) -> int:
        """``index``, for a variable that must be in that list."""
        index = self.index(variable)
        if index is None:
            raise MPIStrategyError(
                f"mpi_strategy: {getattr(variable, 'path', variable)} is not among the "
                "variables the sharded optimizer was built with."
            )
        return index


def plan_of(optimizer: Any, create: bool = False) -> Plan | None:
    """The partition of an optimizer of a sharding MPIStrategy of several
    ranks, made (``create``) at its first slot, the same on every rank; None
    for any other optimizer, and one that made no slot (nothing to shard)."""
    plan = optimizer.__dict__.get(_PLAN)
    if plan is not None or not create:
        return plan
    strategy = _sharding(optimizer)
    variables = list(getattr(optimizer, _keras_internal.KERAS3_OPTIMIZER_BUILT_WITH, ()))
    if strategy is None or not variables:
        return None
    _check_supported(optimizer)
    return _make_plan(optimizer, strategy, variables, _KERAS3)


@dataclass(frozen=True)
class _Kind:
    """What differs between Keras 3's and tf_keras's optimizers here."""

    base: str  # the Keras's optimizer base class, "module:class"
    make: Callable[..., Any]  # (shape, dtype, name) -> a shadow
    positions: str  # the optimizer's dict of its variables' positions, by its _var_key
    # rebuild_slots: the attributes of the variables made before the build
    # (kept), how the variables after them are dropped (and the build undone).
    at_init: tuple[str, ...]
    unbuild: Callable[[Any, list[Any]], None]  # (optimizer, kept variables)
    # What the build makes outside the variables (rebuild_slots keeps it): the
    # attributes of variables its updates advance (``outside_variables``) and
    # of Python counts of its updates, which they read (``count_updates``).
    updated_outside: tuple[str, ...] = ()
    update_counts: tuple[str, ...] = ()


def _kind_of(optimizer: Any) -> _Kind | None:
    """``_KERAS3`` or ``_TF_KERAS``: the Keras whose optimizer base class
    ``optimizer`` is an instance of (of a Keras imported already); else None."""
    for kind in (_KERAS3, _TF_KERAS):
        module, _, name = kind.base.partition(":")
        loaded = sys.modules.get(module)
        if loaded is not None and isinstance(optimizer, getattr(loaded, name)):
            return kind
    return None


def _make_plan(
    optimizer: Any,
    strategy: MPIStrategy,
    variables: Sequence[Any],
    kind: _Kind,
    with_ghosts: bool = False,
) -> Plan:
    """The partition of ``variables`` (the same on every rank) and this
    rank's shadows (and, ``with_ghosts``, ghosts), set on the optimizer."""
    ordered = strategy.extended.ordered_comm
    name = type(optimizer).__name__
    cut = sharding.partition_whole if name in NEVER_CUT else sharding.partition
    pieces = tuple(cut([_rows_and_bytes(v) for v in variables], ordered.size))
    sharding.check_same_partition(ordered, pieces)
    shadows = {
        i: _shadow(strategy, v, piece, kind.make)
        for i, (v, cut) in enumerate(zip(variables, pieces))
        for piece in cut
        if piece.rank == ordered.rank and len(cut) > 1
    }
    ghosts = {
        i: _shadow(strategy, v, sharding.Piece(ordered.rank, 0, 0), kind.make)
        for i, (v, cut) in enumerate(zip(variables, pieces))
        if with_ghosts and all(piece.rank != ordered.rank for piece in cut)
    }
    by_id = {id(v): i for i, v in enumerate(variables)}
    factored = deque(_factored_moments(variables) if name in FACTORED_MOMENTS else ())
    plan = Plan(ordered, tuple(variables), by_id, pieces, shadows, kind, ghosts, factored)
    object.__setattr__(optimizer, _PLAN, plan)  # (not a tracked attribute)
    return plan


def _sharding(optimizer: Any) -> MPIStrategy | None:
    """The optimizer's strategy if it is a sharding MPIStrategy of several ranks."""
    return _sharding_strategy(getattr(optimizer, _keras_internal.KERAS3_OPTIMIZER_STRATEGY, None))


def _sharding_strategy(strategy: Any) -> MPIStrategy | None:
    """``strategy`` if it is a sharding MPIStrategy of several ranks."""
    if (
        isinstance(strategy, MPIStrategy)
        and strategy.extended.shard
        and strategy.extended.comm.Get_size() > 1
    ):
        return strategy
    return None


def _check_supported(optimizer: Any) -> None:
    """Raises (on every rank: at its first slot) for an optimizer this does not
    shard: one whose update of a variable is not elementwise (its rows could
    not be updated apart: Muon's orthogonalized update) and not in
    ``NEVER_CUT``, or that keeps state outside its slots
    (ScheduleFreeAdamW sets its slots from the weights), or a class of its own
    (which may do either)."""
    for method in _keras_internal.KERAS3_SHARDED_UPDATE:
        _keras_internal.check_overridden(method)
    kind = type(optimizer)
    if not (kind.__module__.startswith("keras.") and kind.__name__ in SUPPORTED):
        raise MPIStrategyError(
            f"mpi_strategy: MPIStrategy(shard=...) shards the state of Keras' "
            f"{', '.join(SUPPORTED)}; not of {kind.__name__}, whose update may read a "
            "whole variable or keep state outside its slots. Use MPIStrategy() without shard=."
        )


# Keras 3 optimizers it shards: those whose update_step is elementwise over a
# variable and its slots, all made by add_variable_from_reference with a
# constant initializer, and NEVER_CUT.
SUPPORTED = (
    "SGD",
    "Adam",
    "AdamW",
    "RMSprop",
    "Adagrad",
    "Adadelta",
    "Adamax",
    "Nadam",
    "Lion",
    "Ftrl",
    "Adafactor",
    "Lamb",
)
# ... of which these read a whole variable in its update (Adafactor: the RMS
# of the variable and of its update; Lamb: its trust ratio, the norms of the
# variable and of its update). Their variables are never cut
# (``partition_whole``): each rank runs the update of whole variables, its
# slots all made on it.
NEVER_CUT = ("Adafactor", "Lamb")
# ... and of those, these keep, for a variable of rank >= 2, the mean over
# its rows and over its columns of the squared gradient in two slots made by
# add_variable in build (Adafactor's: _factored_moments).
FACTORED_MOMENTS = ("Adafactor",)


def _factored_moments(variables: Sequence[Any]) -> list[tuple[int, tuple[int, ...]]]:
    """The (position, shape) of each factored moment Adafactor's build makes by
    ``add_variable``, in its order: of each variable of rank >= 2 (but one
    Keras 3 overwrites with its gradient), its rows' mean (the shape but the
    last axis) then its columns' (the shape but the second last)."""
    moments = []
    for i, variable in enumerate(variables):
        shape = tuple(int(d) for d in variable.shape)
        if len(shape) >= 2 and not getattr(variable, "overwrite_with_gradient", False):
            moments += [(i, shape[:-1]), (i, shape[:-2] + shape[-1:])]
    return moments


def _rows_and_bytes(variable: Any) -> tuple[int, int]:
    """(rows, bytes per row) of a variable (rows: its first axis)."""
    shape = tf.TensorShape(variable.shape)
    rows = sharding.rows_of(shape)
    return rows, int(np.prod(shape)) * tf.as_dtype(variable.dtype).size // max(rows, 1)


def _shadow(
    strategy: MPIStrategy, variable: Any, piece: sharding.Piece, make: Callable[..., Any]
) -> Any:
    """A variable of ``piece``'s rows of ``variable``, made by this rank alone
    with ``make`` (shape, dtype, name)."""
    shape = (piece.stop - piece.start, *variable.shape[1:])
    name = f"{variable.name.split(':')[0]}_rows_{piece.start}_{piece.stop}"
    colocated = strategy.extended.colocate_vars_with(_tf_variable(variable))
    with colocated, sharding.slots_start_alike():
        return make(shape, variable.dtype, name)


def holding_slots(optimizer: Any) -> Any:
    """The optimizer that holds ``optimizer``'s slots: a loss scale
    optimizer's inner one (Keras 3's or tf_keras's), else itself."""
    return getattr(optimizer, "inner_optimizer", optimizer)


def built(optimizer: Any) -> bool:
    """Whether a Keras 3 or tf_keras optimizer (or a loss scale optimizer's
    inner one) has made its slots; True for another object (tf_keras's legacy
    optimizers make theirs at their first step)."""
    optimizer = holding_slots(optimizer)
    if _kind_of(optimizer) is _TF_KERAS:
        return bool(getattr(optimizer, _keras_internal.TF_KERAS_OPTIMIZER_BUILT, False))
    return bool(getattr(optimizer, "built", True))


def _keras3_variable(shape: Any, dtype: Any, name: str) -> Any:
    return _keras().Variable(
        initializer="zeros", shape=shape, dtype=dtype, trainable=False, name=name
    )


def _tf_keras_variable(shape: Any, dtype: Any, name: str) -> Any:
    return tf.Variable(tf.zeros(shape, dtype), trainable=False, name=name)


def _keras3_unbuild(optimizer: Any, kept: list[Any]) -> None:
    untrack = getattr(optimizer, _keras_internal.KERAS3_OPTIMIZER_UNTRACK)
    for variable in optimizer.variables[len(kept) :]:
        untrack(variable)
    # (its list holds what it held before the build, to which the build appends
    # its slots at the positions of the first build: saveable)
    _tf_internal.list_rebuilt_in_order(
        getattr(optimizer, _keras_internal.KERAS3_OPTIMIZER_VARIABLES)
    )
    optimizer.built = False


def _tf_keras_unbuild(optimizer: Any, kept: list[Any]) -> None:
    setattr(optimizer, _keras_internal.TF_KERAS_OPTIMIZER_VARIABLES, list(kept))
    setattr(optimizer, _keras_internal.TF_KERAS_OPTIMIZER_BUILT, False)
    optimizer.__dict__.pop(_keras_internal.TF_KERAS_OPTIMIZER_CHECKPOINT_CHILDREN, None)


_KERAS3 = _Kind(
    _keras_internal.KERAS3_BASE_OPTIMIZER,
    _keras3_variable,
    _keras_internal.KERAS3_OPTIMIZER_INDICES,
    _keras_internal.KERAS3_OPTIMIZER_AT_INIT,
    _keras3_unbuild,
)
_TF_KERAS = _Kind(
    _keras_internal.TF_KERAS_OPTIMIZER,
    _tf_keras_variable,
    _keras_internal.TF_KERAS_OPTIMIZER_INDICES,
    _keras_internal.TF_KERAS_OPTIMIZER_AT_INIT,
    _tf_keras_unbuild,
    (_keras_internal.TF_KERAS_NADAM_PRODUCT,),
    (_keras_internal.TF_KERAS_NADAM_PRODUCT_COUNT,),
)


def outside_variables(optimizer: Any) -> list[Any]:
    """The variables a Keras optimizer's updates advance that its
    ``variables`` do not list (tf_keras Nadam's product of its momentum
    schedule; Keras 3's lists its own); [] for another object. The same on
    every rank (made alike by every rank's build)."""
    inner = holding_slots(optimizer)
    kind = _kind_of(inner)
    found = [getattr(inner, name, None) for name in (kind.updated_outside if kind else ())]
    listed = {id(v) for v in inner.variables} if found else set()
    return [v for v in found if isinstance(v, tf.Variable) and id(v) not in listed]


def count_updates(optimizer: Any) -> None:
    """After a Keras optimizer's variables (and ``outside_variables``) were
    set back: sets its Python counts of its updates (tf_keras Nadam's, which
    its eager update reads to tell whether the step's product is made
    already; a tf.function reads it as it traces) to its step count + 1, the
    count at the start of a step, the same on every rank. Nothing for another object."""
    inner = holding_slots(optimizer)
    kind = _kind_of(inner)
    for name in kind.update_counts if kind else ():
        if hasattr(inner, name):
            setattr(inner, name, int(inner.iterations.numpy()) + 1)


def add_variable_from_reference_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """Keras 3 ``TFOptimizer.add_variable_from_reference``: the slot itself on
    the rank that holds all of ``reference_variable``, the slot of its rows on
    a rank that holds some, a placeholder on the others."""

    def make(self: Any, reference_variable: Any, name: Any, initializer: Any) -> Any:
        if name in _REPLICATED_SLOTS:
            return original(self, reference_variable, name=name, initializer=initializer)
        plan = plan_of(self, create=True)
        index = plan.index(reference_variable) if plan else None
        if plan is None or index is None:
            return original(self, reference_variable, name=name, initializer=initializer)
        _check_constant(self, name, initializer)
        _check_factored_made(self, plan, index)
        return _slot(
            plan,
            index,
            reference_variable,
            lambda rows, _: original(self, rows, name=name, initializer=initializer),
        )

    @functools.wraps(original)
    def add_variable_from_reference(
        self: Any, reference_variable: Any, name: Any = None, initializer: Any = "zeros"
    ) -> Any:
        object.__setattr__(self, _FROM_REFERENCE, True)  # (not a tracked attribute)
        try:
            return make(self, reference_variable, name, initializer)
        finally:
            object.__setattr__(self, _FROM_REFERENCE, False)

    return add_variable_from_reference


# Set on a Keras 3 optimizer while its add_variable_from_reference makes a slot
# (by add_variable: not a factored moment).
_FROM_REFERENCE = "_mpi_strategy_from_reference"


def add_variable_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """``add_variable`` of Keras 3's and tf_keras's optimizers: in the build of
    a sharded optimizer of ``FACTORED_MOMENTS`` (Adafactor), each factored
    moment (``_factored_moments``, in order) is made as a slot of its variable
    (on the rank that holds the variable, a placeholder on the others); any
    other variable as Keras makes it."""

    @functools.wraps(original)
    def add_variable(self: Any, shape: Any = None, *args: Any, **kwargs: Any) -> Any:
        plan = None
        if type(self).__name__ in FACTORED_MOMENTS and not self.__dict__.get(_FROM_REFERENCE):
            plan = plan_of(self, create=_kind_of(self) is _KERAS3)
        if plan is None or not plan.factored:
            return original(self, shape, *args, **kwargs)
        index, expected = plan.factored[0]
        made = tuple(int(d) for d in (() if shape is None else shape))
        if made != expected:
            raise MPIStrategyError(_unexpected_build(self, plan, f"a variable of shape {made}"))
        plan.factored.popleft()
        make = lambda *_: original(self, shape, *args, **kwargs)  # noqa: E731
        return _slot(plan, index, None, make, shape=expected)

    return add_variable


def _check_factored_made(optimizer: Any, plan: Plan, index: int) -> None:
    """Raises if a factored moment of a variable up to ``index`` is not made
    yet, as the slot of variable ``index`` is (Adafactor makes them first)."""
    if plan.factored and plan.factored[0][0] <= index:
        raise MPIStrategyError(_unexpected_build(optimizer, plan, "a slot"))


def _unexpected_build(optimizer: Any, plan: Plan, made: str) -> str:
    """The error of a build of ``FACTORED_MOMENTS`` that does not make its
    factored moments as ``_factored_moments`` expects (on every rank)."""
    index, shape = plan.factored[0]
    return (
        f"mpi_strategy: {type(optimizer).__name__}'s build made {made} where "
        f"MPIStrategy(shard=...) expected the factored moment of shape {shape} of "
        f"variable {index}: this Keras builds it otherwise than Keras 3.15 and "
        "tf_keras 2.21. Use MPIStrategy() without shard=."
    )


def _slot(
    plan: Plan,
    index: int,
    reference: Any,
    make: Callable[[Any, Any], Any],
    shape: Any = None,
) -> Any:
    """The slot of variable ``index`` (``reference``) as this rank holds it:
    ``make(variable, piece)`` makes it of ``reference`` (``piece`` None) on the
    rank that holds all of it, of the rows' shadow (``piece``: the rows) on a
    rank that holds some, a placeholder (no data) on the others. ``shape``: the
    slot's, where it is not the variable's (a factored moment; held whole)."""
    shape = reference.shape if shape is None else shape
    held = sharding.Held(plan.pieces[index], plan.ordered, shape)
    here = held.here
    if here is None:
        creator = sharding.placeholder_creator(shape, held.ranks())
        with tf.variable_creator_scope(creator):
            slot = make(reference, None)
    elif held.whole_here:
        with sharding.slots_start_alike():
            slot = make(reference, None)
    else:
        with (
            sharding.slots_start_alike(),
            tf.variable_creator_scope(sharding.rows_creator(here, reference.shape)),
        ):
            slot = make(plan.shadows[index], here)
    sharding.mark_slot(slot, held)
    return slot


def check_rebuildable(optimizer: Any) -> None:
    """Raises (on every rank) for a sharded optimizer whose slots
    ``rebuild_slots`` cannot make again: one with variables made before its
    build other than its step count (and Keras 3's learning rate)."""
    _kept_at_rebuild(optimizer)


def _kept_at_rebuild(optimizer: Any) -> list[Any]:
    """The variables a sharded optimizer made before its build (the first in its list)."""
    kind = _kind_of(optimizer)
    variables = list(optimizer.variables)
    listed = {id(v) for v in variables}
    made = [getattr(optimizer, name, None) for name in kind.at_init] if kind else []
    kept = [v for v in made if id(v) in listed]
    if kind is None or [id(v) for v in variables[: len(kept)]] != [id(v) for v in kept]:
        raise MPIStrategyError(
            f"mpi_strategy.elastic: {type(optimizer).__name__} has variables made before "
            "its build other than its step count and learning rate: its slots cannot be made "
            "again for the survivors. Use MPIStrategy() without shard=."
        )
    return kept


def rebuild_slots(
    optimizer: Any,
    strategy: MPIStrategy,
    built_with: Sequence[Any] | None = None,
    positions: Sequence[int] = (),
) -> None:
    """Makes a sharded optimizer's slots (Keras 3's or tf_keras's) anew for
    the ranks that ``strategy`` spans now (elastic training, after lost
    ranks or as replacements join), on every one of them: the variables its
    ``build`` made are dropped and it builds again, in the strategy's scope,
    with ``built_with`` (default: the variables of its partition; a
    replacement's, built in its world of one rank, has none: the survivors
    name them); each rank then holds its share of the new partition (at their
    initial values: the caller sets them). ``positions``: where ``built_with``
    are in a list every rank holds alike (elastic training: the commit's),
    compared too: two variables of one shape swapped on a rank would be cut
    alike, each slot then set from the other's values."""
    plan, kind = plan_of(optimizer), _kind_of(optimizer)
    if built_with is None and plan is not None:
        built_with = plan.variables
    if kind is None or built_with is None:
        raise MPIStrategyError(f"mpi_strategy: {optimizer!r} is not a sharded optimizer.")
    built_with = list(built_with)
    _check_same_built_with(optimizer, strategy.extended.ordered_comm, built_with, positions)
    kept = _kept_at_rebuild(optimizer)
    names = (*kind.updated_outside, *kind.update_counts)
    outside = {n: getattr(optimizer, n) for n in names if hasattr(optimizer, n)}
    kind.unbuild(optimizer, kept)
    optimizer.__dict__.pop(_PLAN, None)
    with strategy.scope():
        optimizer.build(built_with)
    for name, value in outside.items():
        setattr(optimizer, name, value)


def _check_same_built_with(
    optimizer: Any, ordered: OrderedComm, built_with: list[Any], positions: Sequence[int]
) -> None:
    """Raises on every rank (one all-gather) if the ranks would build
    ``optimizer`` again over variables of other shapes or in another order
    (another partition), or at other ``positions`` (each slot set from
    another variable's). Checked before the build, which leaves the optimizer
    as it was; ``check_same_partition`` would raise only at the next
    collective, naming that one."""
    at = positions or itertools.repeat(None)
    mine = json.dumps(
        [[list(v.shape), tf.as_dtype(v.dtype).name, p] for v, p in zip(built_with, at)]
    ).encode()
    sizes, gathered = ordered.allgather_many(
        [tf.constant([len(mine)], tf.int64), tf.constant(np.frombuffer(mine, np.uint8))]
    )
    ends = np.cumsum(sizes.numpy())[:-1]
    every = [json.loads(bytes(b)) for b in np.split(gathered.numpy(), ends)]
    differ = [_first_difference(r, every[r], every[0]) for r in range(1, len(every))]
    if any(differ):
        raise MPIStrategyError(
            f"mpi_strategy: the ranks would make {type(optimizer).__name__}'s sharded slots "
            "again over different variables (cut differently, or each slot set from "
            "another variable's values): "
            f"{'; '.join(filter(None, differ))}. Every rank builds it over the same "
            "variables (shape, dtype, position where given), in the same order."
        )


def _first_difference(rank: int, built: list[Any], first: list[Any]) -> str:
    """Where ``rank``'s variables (``built``) first differ from rank 0's ('' if nowhere)."""
    if built == first:
        return ""
    at = next(
        (i for i, (a, b) in enumerate(zip(built, first)) if a != b), min(map(len, (built, first)))
    )
    here, there = (_described(x[at]) if at < len(x) else "none" for x in (built, first))
    return (
        f"rank {rank}'s {len(built)} variables differ from rank 0's {len(first)} first at "
        f"#{at}: {here} there, {there} on rank 0"
    )


def _described(variable: list[Any]) -> str:
    """'(3, 2) float32', and ' (position 4)' where its position is given."""
    shape, dtype, position = variable
    return f"{tuple(shape)} {dtype}" + ("" if position is None else f" (position {position})")


def _keras() -> Any:
    """Keras 3 (imported by the program already: these wrappers are installed once it is)."""
    return importlib.import_module("keras")


def _check_constant(optimizer: Any, name: Any, initializer: Any) -> None:
    if type(_keras().initializers.get(initializer)).__name__ not in _CONSTANT_INITIALIZERS:
        raise MPIStrategyError(
            f"mpi_strategy: {type(optimizer).__name__} starts its slot {name!r} with "
            f"{initializer!r}; MPIStrategy(shard=...) shards slots that start at a "
            "constant (each rank makes only its own, with no broadcast)."
        )


def backend_update_step_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """Keras 3 ``TFOptimizer._backend_update_step``: the gradients summed over
    every replica (all of them; under ``shard="gradients"`` only this rank's
    share, by a reduce-scatter), this rank's variables (and rows) updated, the
    others gathered from the ranks that hold them."""

    @functools.wraps(original)
    def _backend_update_step(
        self: Any, grads: Any, trainable_variables: Any, learning_rate: Any
    ) -> Any:
        plan = plan_of(self)
        if plan is None:
            return original(self, grads, trainable_variables, learning_rate)
        strategy = getattr(self, _keras_internal.KERAS3_OPTIMIZER_STRATEGY)
        indices = [plan.position(v) for v in trainable_variables]
        variables = [_tf_variable(v) for v in trainable_variables]
        merge_call = tf.__internal__.distribute.interim.maybe_merge_call
        if strategy.extended.shard == "gradients":
            merge_call(
                _scatter_and_update, strategy, self, plan, grads, variables, indices, learning_rate
            )
        else:
            summed = self._all_reduce_sum_gradients(list(zip(grads, variables)))
            held_here = [(k, grad) for k, (grad, _) in enumerate(summed)]
            whole, rows = _whole_and_rows(plan, held_here, variables, indices, whole_grads=True)
            merge_call(self._distributed_tf_update_step, strategy, whole, learning_rate)
            merge_call(_update_rows, strategy, self, plan, rows, learning_rate)
        merge_call(_assign_from_pieces, strategy, plan, variables, indices)

    return _backend_update_step


def _tf_variable(variable: Any) -> Any:
    """The TensorFlow variable of a Keras 3 variable (a tf_keras one is one)."""
    return variable if isinstance(variable, tf.Variable) else variable.value


def _scatter_and_update(
    distribution: Any,
    optimizer: Any,
    plan: Plan,
    grads: Sequence[Any],
    variables: Sequence[Any],
    indices: Sequence[int],
    learning_rate: Any,
) -> None:
    """ZeRO stage 2: each rank receives the sum of its rows of the gradients
    (one reduce-scatter) and updates them; a whole variable's gradient arrives
    whole, a piece's as its rows."""
    mine = _scatter(distribution, plan, grads, variables, indices)
    whole, rows = _whole_and_rows(plan, mine.items(), variables, indices, whole_grads=False)
    optimizer._distributed_tf_update_step(distribution, whole, learning_rate)
    _update_rows(distribution, optimizer, plan, rows, learning_rate)


def _scatter(
    distribution: Any,
    plan: Plan,
    grads: Sequence[Any],
    variables: Sequence[Any],
    indices: Sequence[int],
) -> dict[int, tf.Tensor]:
    """This rank's rows of ``grads`` (its replicas' gradients of ``variables``)
    summed over every replica, by one reduce-scatter: {position in ``grads``:
    the whole gradient of a variable held whole here, the rows' of one held in
    part}."""
    local = [cross_device_ops.dense_local_sum(g) for g in grads]
    pieces = [plan.pieces[i] for i in indices]
    timeout = distribution.extended.timeout_seconds
    shapes = [tf.TensorShape(v.shape) for v in variables]
    return sharding.scatter_pieces(plan.ordered, local, shapes, pieces, timeout)


def _whole_and_rows(
    plan: Plan,
    grads: Any,
    variables: Sequence[Any],
    indices: Sequence[int],
    whole_grads: bool,
) -> tuple[list[Any], list[Any]]:
    """Of ``grads`` ((position, gradient) pairs), the (gradient, variable)
    pairs of the variables this rank holds whole, and the ``_update_rows``
    entries of those it holds rows of (``whole_grads``: the gradient is of the
    whole variable, else of the rows); variables held elsewhere are left out."""
    whole, rows = [], []
    for k, grad in grads:
        i = indices[k]
        held = sharding.Held(plan.pieces[i], plan.ordered, variables[k].shape)
        if held.whole_here:
            whole.append((grad, variables[k]))
        elif held.here is not None:
            rows.append((grad, whole_grads, variables[k], plan.shadows[i], held.here))
    return whole, rows


def _update_rows(
    distribution: Any, optimizer: Any, plan: Plan, rows: Sequence[Any], *step_args: Any
) -> None:
    """The optimizer's own update of this rank's rows of variables held in
    pieces: each shadow takes the rows of its variable, and the update
    (``update_step(rows, shadow, *step_args)``) those rows of its gradient
    (``whole_grad``; else the gradient is of the rows).
    (Flags and pieces, not new objects per replica: a merge call would take
    those for per-replica values.)"""
    indices = getattr(optimizer, plan.kind.positions)
    for grad, whole_grad, variable, shadow, piece in rows:
        key = optimizer._var_key(shadow)
        indices[key] = indices[optimizer._var_key(variable)]  # (its slots: the rows')
        try:
            distribution.extended.update(
                _tf_variable(shadow),
                functools.partial(_update_piece, optimizer, piece, whole_grad),
                args=(grad, variable, *step_args),
                group=False,
            )
        finally:
            del indices[key]


def _update_piece(
    optimizer: Any,
    piece: sharding.Piece,
    whole_grad: bool,
    shadow: Any,
    grad: Any,
    variable: Any,
    *step_args: Any,
) -> Any:
    if piece.stop > piece.start:  # (a ghost has no rows)
        shadow.assign(variable[piece.start : piece.stop])
    grad = tf.convert_to_tensor(grad)
    rows = grad[piece.start : piece.stop] if whole_grad else grad
    return optimizer.update_step(rows, shadow, *step_args)


def _assign_from_pieces(
    distribution: Any, plan: Plan, variables: Sequence[Any], indices: Sequence[int]
) -> None:
    # In build order, each variable is one run of what the all-gather brings.
    variables, indices = zip(*sorted(zip(variables, indices), key=lambda pair: pair[1]))
    pieces = [plan.pieces[i] for i in indices]
    mine = {}
    for k, (variable, i) in enumerate(zip(variables, indices)):
        if any(p.rank == plan.ordered.rank for p in plan.pieces[i]):
            held = _tf_variable(plan.shadows[i]) if i in plan.shadows else variable
            mine[k] = tf.convert_to_tensor(held)
    shapes = [tf.TensorShape(v.shape) for v in variables]
    dtypes = [v.dtype for v in variables]
    timeout = distribution.extended.timeout_seconds
    gathered = sharding.gather_pieces(plan.ordered, shapes, dtypes, pieces, mine, timeout)
    for variable, value in zip(variables, gathered):
        if value is not None:
            distribution.extended.update(variable, _assign, args=(value,), group=False)


def _assign(variable: Any, value: tf.Tensor) -> Any:
    return variable.assign(value)


def save_own_variables_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """Keras 3 ``BaseOptimizer.save_own_variables``: every slot whole, put
    together from its pieces on every rank, one slot at a time (the writer keeps it)."""

    @functools.wraps(original)
    def save_own_variables(self: Any, store: Any) -> Any:
        if not _saved_sharded(self):
            return original(self, store)
        for i, variable in enumerate(self.variables):
            store[str(i)] = _whole(variable)
        return None

    return save_own_variables


def _saved_sharded(optimizer: Any) -> bool:
    """Whether a save of ``optimizer`` gathers its sharded slots (a collective:
    raises on a rank saving alone)."""
    if plan_of(optimizer) is None:
        return False
    if write_point.alone():
        raise MPIStrategyError(_SAVED_ALONE)
    return True


_SAVED_ALONE = (
    "mpi_strategy: a save of a sharded optimizer's state (MPIStrategy(shard=...)) "
    "made on some ranks only: each rank holds its share, so every rank makes the save "
    "call (one copy is written), as a one-process program does."
)


def _whole(variable: Any) -> np.ndarray:
    """An optimizer variable's whole value, on every rank (collective for a sharded slot)."""
    held = sharding.held(variable)
    if held is None:
        return np.asarray(variable.numpy())
    shape, dtype = tf.TensorShape(held.shape), tf.as_dtype(variable.dtype)
    mine = {0: tf.convert_to_tensor(_tf_variable(variable))} if held.here else {}
    (value,) = sharding.gather_pieces(held.ordered, [shape], [dtype], [held.pieces], mine)
    return np.asarray(variable.numpy() if value is None else value)


def load_own_variables_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """Keras 3 ``BaseOptimizer.load_own_variables``: sets the slots (and rows) this rank holds."""

    @functools.wraps(original)
    def load_own_variables(self: Any, store: Any) -> Any:
        if plan_of(self) is None or len(store.keys()) != len(self.variables):
            return original(self, store)  # (Keras warns about a mismatch)
        for i, variable in enumerate(self.variables):
            set_held(variable, store[str(i)])
        return None

    return load_own_variables


def set_held(variable: Any, whole: Any) -> None:  # (also elastic training's)
    """Sets what this rank holds of an optimizer variable from its ``whole`` value."""
    held = sharding.held(variable)
    if held is None or held.whole_here:
        variable.assign(whole)
    elif held.here is not None:
        variable.assign(whole[held.here.start : held.here.stop])


def set_weights_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """``set_weights`` of Keras 3's and tf_keras's optimizers (which Keras' legacy
    ``.h5`` load calls with the whole saved values): a sharded optimizer sets
    the slots and rows this rank holds, on every rank, with no communication."""

    @functools.wraps(original)
    def set_weights(self: Any, weights: Sequence[Any]) -> Any:
        if plan_of(self) is None or len(weights) != len(self.variables):
            return original(self, weights)
        for variable, weight in zip(self.variables, weights):
            held = sharding.held(variable)
            shape = tuple(variable.shape if held is None else held.shape)
            if tuple(np.shape(weight)) != shape:
                raise ValueError(  # (what Keras raises; its .h5 load warns and goes on)
                    f"Optimizer variable {_name(variable)} has shape {shape} not compatible "
                    f"with provided weight shape {tuple(np.shape(weight))}."
                )
            set_held(variable, np.asarray(weight))
        return None

    return set_weights


def save_h5_optimizer_weights_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """Keras' legacy ``.h5`` save of an optimizer's variables (Keras 3's and
    tf_keras's ``save_optimizer_weights_to_hdf5_group``): a sharded optimizer's
    are written whole, each put together on every rank from the ranks that hold
    it (all of them before the write: Keras' writer reads every weight first)."""

    @functools.wraps(original)
    def save_optimizer_weights(group: Any, optimizer: Any) -> Any:
        if not _saved_sharded(optimizer):
            return original(group, optimizer)
        return original(group, _WholeWeights(optimizer))

    return save_optimizer_weights


class _WholeWeights:
    """What Keras' ``.h5`` save reads of an optimizer that is not one of its
    own (``weights``): each variable's whole value, under the optimizer's names."""

    def __init__(self, optimizer: Any) -> None:
        self.weights = [_WholeWeight(_name(v), _whole(v)) for v in optimizer.variables]


@dataclass(frozen=True)
class _WholeWeight:
    """A variable's whole value, named as Keras 3 (``path``) and tf_keras (``name``) name it."""

    path: str
    value: np.ndarray

    @property
    def name(self) -> str:
        return self.path

    def numpy(self) -> np.ndarray:  # (tf_keras's batch_get_value)
        return self.value

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:  # (Keras 3's)
        return self.value if dtype is None else self.value.astype(dtype)


def _name(variable: Any) -> str:
    """The name Keras' ``.h5`` save writes an optimizer variable under."""
    return str(getattr(variable, "path", variable.name))


def tf_keras_build_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """tf_keras's ``_BaseOptimizer.build``: in a sharding MPIStrategy of
    several ranks, partitions ``var_list`` before the optimizer makes its slots
    (raises for an optimizer it does not shard)."""

    @functools.wraps(original)
    def build(self: Any, var_list: Any) -> Any:
        strategy = _sharding(self)
        if strategy is not None and not getattr(self, "_built", False) and plan_of(self) is None:
            _check_tf_keras_supported(self)
            for method in _keras_internal.TF_KERAS_SHARDED_UPDATE:
                _keras_internal.check_overridden(method)
            ghosts = type(self).__name__ in _TF_KERAS_STATE_IN_UPDATE
            _make_plan(self, strategy, list(var_list), _TF_KERAS, with_ghosts=ghosts)
        return original(self, var_list)

    return build


# tf_keras optimizers whose update_step is elementwise over a variable and its
# slots, all made by add_variable_from_reference (at a constant, or, Ftrl's
# accumulator, from a whole initial value, of which a slot of rows takes its
# rows), and NEVER_CUT: Keras 3's list (it has no Lamb).
TF_KERAS_SUPPORTED = SUPPORTED
# ... of which these advance state outside the slots in update_step: Nadam's
# product of its momentum schedule, _u_product (in tf.function, by a tf.cond
# on a Python counter advanced as each variable's update is traced: its value
# depends on how many updates came before in the step). Every rank runs the
# update of every variable, in order, that of a variable it holds none of on
# no rows (its ghost), so that the product is the unsharded run's.
_TF_KERAS_STATE_IN_UPDATE = ("Nadam",)


def _check_tf_keras_supported(optimizer: Any) -> None:
    kind = type(optimizer)
    if not (kind.__module__.startswith("tf_keras.") and kind.__name__ in TF_KERAS_SUPPORTED):
        raise MPIStrategyError(
            f"mpi_strategy: MPIStrategy(shard=...) shards the state of tf_keras' "
            f"{', '.join(TF_KERAS_SUPPORTED)}; not of {kind.__name__}, whose update may read a "
            "whole variable or keep state outside its slots. Use MPIStrategy() without shard=."
        )


def tf_keras_legacy_create_all_weights_wrapper(
    original: Callable[..., Any],
) -> Callable[..., Any]:
    """tf_keras's legacy ``OptimizerV2._create_all_weights`` (its slots, made at
    the first step): raises on every rank in a sharding MPIStrategy of several
    ranks, where it would keep the whole state on every rank."""

    @functools.wraps(original)
    def _create_all_weights(self: Any, var_list: Any) -> Any:
        strategy = _sharding(self) or _sharding_strategy(tf.distribute.get_strategy())
        if strategy is not None:
            raise MPIStrategyError(
                f"mpi_strategy: MPIStrategy(shard={strategy.extended.shard!r}) does not shard "
                f"tf_keras's legacy optimizers ({type(self).__name__}): each rank would hold "
                f"its whole state. Use tf_keras.optimizers.{type(self).__name__} (not legacy) "
                "with shard='optimizer', or MPIStrategy() without shard=."
            )
        return original(self, var_list)

    return _create_all_weights


def tf_keras_add_variable_from_reference_wrapper(
    original: Callable[..., Any],
) -> Callable[..., Any]:
    """tf_keras's ``Optimizer.add_variable_from_reference``: as Keras 3's
    (``_slot``); a slot of rows starts from the rows of ``initial_value``."""

    @functools.wraps(original)
    def add_variable_from_reference(
        self: Any,
        model_variable: Any,
        variable_name: Any,
        shape: Any = None,
        initial_value: Any = None,
    ) -> Any:
        plan = plan_of(self)
        index = plan.index(model_variable) if plan else None
        if plan is None or index is None or variable_name in _REPLICATED_SLOTS:
            return original(self, model_variable, variable_name, shape, initial_value)
        _check_factored_made(self, plan, index)

        def make(rows: Any, piece: sharding.Piece | None) -> Any:
            start = initial_value
            if piece is not None and initial_value is not None:
                start = tf.convert_to_tensor(initial_value)[piece.start : piece.stop]
            return original(self, rows, variable_name, shape, start)

        return _slot(plan, index, model_variable, make)

    return add_variable_from_reference


def tf_keras_aggregate_gradients_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """tf_keras's ``Optimizer.aggregate_gradients`` (the sum over the replicas
    ``apply_gradients`` and ``LossScaleOptimizer`` make) under
    ``shard="gradients"``: this rank's share of the summed gradients, by one
    reduce-scatter (``_scatter``), in place of the all-reduce: a variable's
    whole gradient where this rank holds it whole, its rows' where it holds
    rows, an empty gradient where it holds none. Every rank gets its own share;
    the clipping that follows waits for the step (``_clip_shares``)."""

    @functools.wraps(original)
    def aggregate_gradients(self: Any, grads_and_vars: Any) -> Any:
        plan, strategy = plan_of(self), _sharding(self)
        if plan is None or strategy is None or strategy.extended.shard != "gradients":
            return original(self, grads_and_vars)
        pairs = list(grads_and_vars)
        given = [k for k, (grad, _) in enumerate(pairs) if grad is not None]
        shares = tf.__internal__.distribute.interim.maybe_merge_call(
            _scatter_shares,
            strategy,
            plan,
            [pairs[k][0] for k in given],
            [pairs[k][1] for k in given],
        )
        for k, share in zip(given, shares):
            pairs[k] = (share, pairs[k][1])
        object.__setattr__(self, _SCATTERED, True)  # (not a tracked attribute)
        return pairs

    return aggregate_gradients


# Set on a tf_keras optimizer from the reduce-scatter of its gradients to its
# step (shard="gradients"): the gradients it is given are this rank's shares.
_SCATTERED = "_mpi_strategy_scattered"


def _scatter_shares(
    distribution: Any, plan: Plan, grads: Sequence[Any], variables: Sequence[Any]
) -> list[tf.Tensor]:
    """Each gradient's share on this rank (``_scatter``), an empty one for a
    variable held elsewhere."""
    indices = [plan.position(v) for v in variables]
    mine = _scatter(distribution, plan, grads, variables, indices)
    empty = [tf.zeros([0], distribution.experimental_local_results(g)[0].dtype) for g in grads]
    return [mine.get(k, empty[k]) for k in range(len(grads))]


def tf_keras_clip_gradients_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """tf_keras's ``_BaseOptimizer._clip_gradients``: the shares of a
    reduce-scatter are clipped in the step, with the norms of the whole
    gradients (``_clip_shares``); other gradients as tf_keras clips them."""

    @functools.wraps(original)
    def _clip_gradients(self: Any, grads: Any) -> Any:
        if self.__dict__.get(_SCATTERED):
            return list(grads)
        return original(self, grads)

    return _clip_gradients


def tf_keras_apply_gradients_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """tf_keras's ``Optimizer._distributed_apply_gradients_fn`` (in the merge
    call, with the summed gradients, or this rank's shares of them: clipped
    first, ``_clip_shares``): this rank's variables (and rows) updated, in the
    order given, the others gathered from the ranks that hold them; then the
    original for the rest of the step (EMA, the step count), its own updates
    skipped (``tf_keras_update_step_wrapper``)."""

    @functools.wraps(original)
    def _distributed_apply_gradients_fn(
        self: Any, distribution: Any, grads_and_vars: Any, **kwargs: Any
    ) -> Any:
        plan = plan_of(self)
        if plan is None:
            return original(self, distribution, grads_and_vars, **kwargs)
        grads_and_vars = list(grads_and_vars)
        variables = [v for _, v in grads_and_vars]
        indices = [plan.position(v) for v in variables]
        grads = [g for g, _ in grads_and_vars]
        scattered = self.__dict__.get(_SCATTERED, False)
        if scattered:
            object.__setattr__(self, _SCATTERED, False)
            shares = [distribution.experimental_local_results(g)[0] for g in grads]
            grads = _clip_shares(distribution, self, plan, shares, indices)
        for grad, variable, i in zip(grads, variables, indices):
            _update_held(distribution, self, plan, grad, variable, i, whole_grad=not scattered)
        _assign_from_pieces(distribution, plan, variables, indices)
        object.__setattr__(self, _UPDATED, True)  # (not a tracked attribute)
        try:
            return original(self, distribution, grads_and_vars, **kwargs)
        finally:
            object.__setattr__(self, _UPDATED, False)

    return _distributed_apply_gradients_fn


def _update_held(
    distribution: Any,
    optimizer: Any,
    plan: Plan,
    grad: Any,
    variable: Any,
    index: int,
    whole_grad: bool,
) -> None:
    """The update of what this rank holds of ``variable`` (position ``index``),
    from ``grad`` (the whole variable's, or, not ``whole_grad``, of the rows held)."""
    held = sharding.Held(plan.pieces[index], plan.ordered, variable.shape)
    if held.whole_here:
        distribution.extended.update(
            variable, functools.partial(_step, optimizer), args=(grad,), group=False
        )
    elif held.here is not None:
        entry = (grad, whole_grad, variable, plan.shadows[index], held.here)
        _update_rows(distribution, optimizer, plan, [entry])
    elif index in plan.ghosts:
        ghost = plan.ghosts[index]
        nothing = tf.zeros(ghost.shape, ghost.dtype)
        entry = (nothing, False, variable, ghost, sharding.Piece(plan.ordered.rank, 0, 0))
        with sharding.reading_placeholders_as_empty():
            _update_rows(distribution, optimizer, plan, [entry])


def _clip_shares(
    distribution: Any, optimizer: Any, plan: Plan, shares: Sequence[Any], indices: Sequence[int]
) -> list[Any]:
    """This rank's shares of the summed gradients, clipped as tf_keras clips
    the whole ones (``_clip_gradients``): ``clipnorm`` by the norm of each
    variable's whole gradient and ``global_clipnorm`` by that of all of them,
    the squares of each share summed over the ranks (one all-reduce of a
    number per variable: exact for a variable held whole, within rounding for
    one held in rows); ``clipvalue`` elementwise."""
    timeout = distribution.extended.timeout_seconds
    clipnorm, global_clipnorm = optimizer.clipnorm, optimizer.global_clipnorm
    if clipnorm and clipnorm > 0:
        squares = [tf.reduce_sum(s * s) for s in shares]
        totals = tf.unstack(plan.ordered.allreduce_sum(tf.stack(squares), timeout))
        return [
            _clip_by_norm_of(s, total, clipnorm, whole=_held_whole(plan, i, s))
            for s, total, i in zip(shares, totals, indices)
        ]
    if global_clipnorm and global_clipnorm > 0:
        halves = [tf.nn.l2_loss(s) for s in shares]
        half = tf.reduce_sum(plan.ordered.allreduce_sum(tf.stack(halves), timeout))
        norm = tf.sqrt(half * tf.constant(2.0, half.dtype))
        return tf.clip_by_global_norm(shares, global_clipnorm, use_norm=norm)[0]
    return list(optimizer._clip_gradients(shares))  # (clipvalue, elementwise)


def _held_whole(plan: Plan, index: int, share: Any) -> bool:
    return bool(sharding.Held(plan.pieces[index], plan.ordered, share.shape).whole_here)


def _clip_by_norm_of(share: Any, l2sum: tf.Tensor, clip_norm: float, whole: bool) -> Any:
    """``tf.clip_by_norm`` of the whole gradient, on ``share``: itself where
    the share is the whole gradient (the same bits); else by the norm of the
    whole, whose squares sum to ``l2sum``."""
    if whole:
        return tf.clip_by_norm(share, clip_norm)
    positive = l2sum > 0
    norm = tf.where(positive, tf.sqrt(tf.where(positive, l2sum, tf.ones_like(l2sum))), l2sum)
    return share * clip_norm / tf.maximum(norm, clip_norm)


def _step(optimizer: Any, variable: Any, grad: Any) -> Any:
    return optimizer._update_step(grad, variable)


def tf_keras_update_step_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """tf_keras's ``_BaseOptimizer._update_step``: nothing, for a sharded
    optimizer's step whose updates were made (``tf_keras_apply_gradients_wrapper``)."""

    @functools.wraps(original)
    def _update_step(self: Any, gradient: Any, variable: Any) -> Any:
        if self.__dict__.get(_UPDATED):
            return None
        return original(self, gradient, variable)

    return _update_step
