"""Sharded optimizer state (ZeRO stage 1): the mechanism, framework-free of Keras.

With ``MPIStrategy(shard="optimizer")`` each rank keeps the optimizer's
per-variable state (its *slots*: Adam's moments, momentum, ...) only for the
variables it owns, updates only those variables from the all-reduced
gradients, and the ranks then all-gather the updated variables. The pieces:

* ``partition``: which rank owns which variable, whole variables balanced by
  bytes, the same on every rank whatever order the variables come in;
* ``SlotPlaceholder``: what stands for a slot this rank does not own (no data;
  checkpoints record it and write nothing for it, restores skip it, reads raise);
* ``gather_from_owners``: one all-gather of the owned variables' new values.

``features/sharding.py`` decides, per Keras optimizer, when each is used.
"""

from __future__ import annotations

import contextlib
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from mpi_strategy._src import _tf_internal
from mpi_strategy._src.core.errors import MPIStrategyError
from mpi_strategy._src.core.process import PROCESS
from mpi_strategy._src.distribute.ordered_comm import OrderedComm

MODES = (None, "optimizer")


def resolve(shard: str | None) -> str | None:
    """``shard`` checked (the same on every rank: it is the program's)."""
    if shard == "gradients":
        raise MPIStrategyError(
            "mpi_strategy: MPIStrategy(shard='gradients') (ZeRO stage 2) is not built yet; "
            "shard='optimizer' partitions the optimizer's state (docs/sharding.md)."
        )
    if shard not in MODES:
        raise MPIStrategyError(
            f"mpi_strategy: MPIStrategy(shard={shard!r}): expected one of {list(MODES)}."
        )
    return shard


def partition(units: Sequence[tuple[str, int]], size: int) -> list[int]:
    """The owner rank of each unit ``(name, nbytes)``, in the order given.

    Largest first (ties by name), each to the least-loaded rank (ties to the
    lowest): no rank holds more than total/size + the largest unit. The result
    depends on the set of units, not on their order (names must be unique).
    """
    load = [0] * size
    owners = [0] * len(units)
    for i in sorted(range(len(units)), key=lambda i: (-units[i][1], units[i][0])):
        rank = min(range(size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += units[i][1]
    return owners


def check_same_partition(
    ordered: OrderedComm, units: Sequence[tuple[str, int]], owners: Sequence[int]
) -> None:
    """Makes the next collective raise on every rank if ranks partitioned differently."""
    digest = zlib.crc32(repr(list(zip(units, owners))).encode())
    ordered.check_same_constants([np.array([digest], np.uint32)])


class SlotPlaceholder(_tf_internal.ResourceVariable):
    """A slot that rank ``owner`` holds: no data here (shape [0]).

    In a checkpoint it is recorded as a value of ``full_shape`` that this rank
    does not write (the owner writes it); a restore skips it; reading or
    assigning it raises (a code path that would train on it must not)."""

    def __init__(self, full_shape: tf.TensorShape, dtype: tf.DType, owner: int, name: str) -> None:
        super().__init__(
            initial_value=tf.zeros([0], dtype), trainable=False, name=name, dtype=dtype
        )
        self.full_shape = tf.TensorShape(full_shape)
        self.owner = owner

    def _refuse(self, *_: Any, **__: Any) -> Any:
        raise MPIStrategyError(
            f"mpi_strategy: optimizer slot {self.name} of shape {self.full_shape} lives on "
            f"rank {self.owner} (MPIStrategy(shard='optimizer')); this rank holds none of it."
        )

    numpy = read_value = value = assign = assign_add = assign_sub = _refuse

    def __repr__(self) -> str:
        return f"<SlotPlaceholder {self.name} shape={self.full_shape} owner=rank {self.owner}>"

    def _serialize_to_tensors(self) -> dict[str, Any]:
        # A value of None: in the object graph, not in this rank's files.
        spec = _tf_internal.SaveSpec(lambda: None, "", "", dtype=self.dtype, device=self.device)
        return {_tf_internal.VARIABLE_VALUE_KEY: spec}

    def _restore_from_tensors(self, restored_tensors: Any) -> Any:
        return tf.no_op()


def placeholder_creator(full_shape: Any, owner: int) -> Callable[..., SlotPlaceholder]:
    """A ``tf.variable_creator_scope`` creator that makes ``SlotPlaceholder``s
    of slots of ``full_shape`` that rank ``owner`` holds (the requested initial
    value is never computed)."""

    def create(next_creator: Any, **kwargs: Any) -> SlotPlaceholder:
        del next_creator
        dtype = tf.as_dtype(kwargs.get("dtype") or tf.float32)
        with tf.init_scope():
            return SlotPlaceholder(full_shape, dtype, owner, kwargs.get("name") or "slot")

    return create


_local = threading.local()


@contextlib.contextmanager
def slots_start_alike() -> Iterator[None]:
    """Variables created in the block are slots with a constant initializer,
    which starts them alike on every rank without rank 0's broadcast (only
    their owner creates them: a broadcast would be a collective of one)."""
    previous = getattr(_local, "alike", False)
    _local.alike = True
    try:
        yield
    finally:
        _local.alike = previous


def starting_alike() -> bool:
    """True inside ``slots_start_alike``."""
    return getattr(_local, "alike", False)


def gather_from_owners(
    ordered: OrderedComm, variables: Sequence[Any], owners: Sequence[int]
) -> list[tf.Tensor | None]:
    """Every variable's value as its owner holds it, on every rank: one
    all-gather of each rank's owned variables (flattened, one tensor per
    dtype). Returns None for this rank's own variables (unchanged)."""
    dtypes = sorted({v.dtype for v in variables}, key=lambda d: d.name)
    mine = [
        _flat([v for v, o in zip(variables, owners) if o == ordered.rank and v.dtype == d], d)
        for d in dtypes
    ]
    gathered = dict(zip(dtypes, ordered.allgather_many(mine)))
    values: list[tf.Tensor | None] = [None] * len(variables)
    for d in dtypes:
        order = sorted(
            (i for i, v in enumerate(variables) if v.dtype == d), key=lambda i: (owners[i], i)
        )
        sizes = [variables[i].shape.num_elements() for i in order]
        for i, part in zip(order, tf.split(gathered[d], sizes)):
            if owners[i] != ordered.rank:
                values[i] = tf.reshape(part, variables[i].shape)
    return values


def _flat(variables: Sequence[Any], dtype: tf.DType) -> tf.Tensor:
    if not variables:
        return tf.zeros([0], dtype)
    return tf.concat([tf.reshape(tf.convert_to_tensor(v), [-1]) for v in variables], 0)


class Held(NamedTuple):
    """Where a sharded optimizer's slot is: rank ``owner`` of ``ordered``."""

    owner: int
    ordered: OrderedComm


# Set on each slot (the Keras variable) of a sharded optimizer.
_HELD = "_mpi_strategy_held"


@dataclass
class ShardingState:
    """Sharding's part of the process state (``PROCESS.of``)."""

    slots_marked: int = 0  # (none yet: saves need not look for any)


def mark_slot(slot: Any, held: Held) -> None:
    """Records that ``slot`` (an optimizer variable) is held by one rank alone."""
    object.__setattr__(slot, _HELD, held)
    PROCESS.of(ShardingState).slots_marked += 1


def mark_replicated(slot: Any) -> None:
    """Records that ``slot`` of a sharding strategy's optimizer is kept whole
    by design (every rank updates it for every variable)."""
    object.__setattr__(slot, _HELD, _REPLICATED)


def is_replicated(obj: Any) -> bool:
    """True for a slot marked by ``mark_replicated``."""
    return getattr(obj, _HELD, None) is _REPLICATED


_REPLICATED = "replicated"


def any_slots_marked() -> bool:
    """False until this process made a sharded optimizer's slot."""
    return PROCESS.of(ShardingState).slots_marked > 0


def held(obj: Any) -> Held | None:
    """Where ``obj`` is held if it is a sharded optimizer's slot, else None."""
    found = getattr(obj, _HELD, None)
    return found if isinstance(found, Held) else None
