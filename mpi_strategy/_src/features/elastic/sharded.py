"""Elastic training of a sharded optimizer (``MPIStrategy(shard=...)``, Keras 3, tf_keras).

Each rank holds only its share of the optimizer's slots, so a commit also
sends this rank's share to the next rank (``copy_to_buddy``: one ring
exchange, rank r to rank r + 1 mod N), which keeps it with its own: 2/N of
the slots per rank instead of 1/N. After a recovery, every share of the
commit's partition is on a survivor if no two neighbours were lost (rank r and
r + 1 mod N): the survivors put each slot together from those holders, one
slot at a time, and each keeps its share of the partition over the survivors
(``restore``), after the optimizer made its slots again for that partition
(``features/sharding.rebuild_slots``). When replacements join
(``replace_lost=True``), the same ``restore`` cuts the slots for the grown
world, the replacements holding no piece (``newcomers_copies``;
``recovery.grown``). Every rank builds each optimizer again over the
variables the commit names (``Copies.built_with``): a replacement's, built in
its world of one rank, has no partition of its own to rebuild by.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from mpi_strategy._src.core import failure
from mpi_strategy._src.core.errors import MPIStrategyError
from mpi_strategy._src.distribute import sharding
from mpi_strategy._src.distribute.ordered_comm import OrderedComm
from mpi_strategy._src.distribute.strategy import MPIStrategy
from mpi_strategy._src.features import sharding as sharded_optimizers


class ShardLostError(MPIStrategyError):
    """Two neighbouring ranks were lost: a share of a sharded optimizer's
    slots and its copy are both gone (every survivor raises it)."""


ShardLostError.__module__ = "mpi_strategy.elastic"  # its public name
failure.raised_by_every_living_rank(lambda error: isinstance(error, ShardLostError))


@dataclass(frozen=True)
class Slot:
    """A sharded slot in a commit: its position among the state's variables
    and its pieces over the ranks of the commit."""

    position: int
    pieces: tuple[sharding.Piece, ...]
    shape: tuple[int, ...]
    dtype: Any  # numpy's

    def row_elements(self) -> int:
        return int(np.prod(self.shape[1:])) if self.shape else 1


@dataclass(frozen=True)
class Copies:
    """A commit's sharded slots: this rank's rank and the world size when it
    was made, the slots, the buddy's (rank - 1 mod size) pieces of them (flat,
    by position), and what each sharded optimizer was built with: (its
    position among the state's optimizers, its variables' positions among the
    commit's variables, in the order it was built with them)."""

    rank: int
    size: int
    slots: tuple[Slot, ...]
    buddy: dict[int, np.ndarray]
    built_with: tuple[tuple[int, tuple[int, ...]], ...]


NEWCOMER = -1  # the rank in ``Copies`` of a replacement: it held no piece


def described(copies: Copies) -> dict[str, Any]:
    """What a replacement needs of a survivor's ``copies`` (JSON-able): the
    world size, the slots and what the optimizers were built with, not the
    pieces (``newcomers_copies``)."""
    return {
        "size": copies.size,
        "slots": [
            [s.position, [list(p) for p in s.pieces], list(s.shape), tf.as_dtype(s.dtype).name]
            for s in copies.slots
        ],
        "built_with": [[k, list(positions)] for k, positions in copies.built_with],
    }


def newcomers_copies(description: dict[str, Any]) -> Copies:
    """A replacement's ``Copies`` of the commit ``described`` by a survivor: it
    holds no piece, so ``restore`` takes every piece from the survivors."""
    slots = tuple(
        Slot(
            position,
            tuple(sharding.Piece(*p) for p in pieces),
            tuple(shape),
            tf.as_dtype(dtype).as_numpy_dtype,
        )
        for position, pieces, shape, dtype in description["slots"]
    )
    built_with = tuple((k, tuple(positions)) for k, positions in description["built_with"])
    return Copies(NEWCOMER, description["size"], slots, {}, built_with)


def positions_of(copies: Copies) -> list[int]:
    """The positions among the commit's variables that ``copies`` names (of
    its slots and of the variables the optimizers were built with)."""
    return [s.position for s in copies.slots] + [p for _, ps in copies.built_with for p in ps]


def check_supported(trackables: Sequence[Any]) -> None:
    """Raises (on every rank: at a commit) for a sharded optimizer whose
    slots ``restore`` cannot make again (``sharding.check_rebuildable``)."""
    for optimizer in optimizers(trackables):
        if sharded_optimizers.plan_of(optimizer) is not None:
            sharded_optimizers.check_rebuildable(optimizer)


def optimizers(trackables: Sequence[Any]) -> list[Any]:
    """The optimizers among ``trackables`` (of a loss scale optimizer: its
    inner one, which holds the slots), in order."""
    inner = [sharded_optimizers.holding_slots(t) for t in trackables]
    return [t for t in inner if hasattr(t, "iterations")]


def _built_with(
    trackables: Sequence[Any], variables: Sequence[Any]
) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """``Copies.built_with`` of a commit of ``variables``; raises (on every
    rank) for a sharded optimizer built with a variable not among them."""
    position = {id(v): k for k, v in enumerate(variables)}
    built = []
    for k, optimizer in enumerate(optimizers(trackables)):
        plan = sharded_optimizers.plan_of(optimizer)
        if plan is None:
            continue
        missing = [v.name for v in plan.variables if id(v) not in position]
        if missing:
            raise MPIStrategyError(
                f"mpi_strategy.elastic: the sharded optimizer {type(optimizer).__name__} "
                f"was built with variables that are not in the State ({', '.join(missing)}): "
                "pass elastic.State the models it trains too."
            )
        built.append((k, tuple(position[id(v)] for v in plan.variables)))
    return tuple(built)


def held_elsewhere(variable: Any) -> bool:
    """True for a sharded slot this rank holds none of (it has no data here)."""
    held = sharding.held(variable)
    return held is not None and held.here is None


def copy_to_buddy(
    trackables: Sequence[Any], variables: Sequence[Any], arrays: Sequence[Any]
) -> Copies | None:
    """For a commit of ``variables`` of ``trackables`` (``arrays``: their
    values, None for a slot held elsewhere): the ``Copies`` of its sharded
    slots and optimizers, after this rank sent its pieces to rank + 1 and
    received rank - 1's (one all-to-all per dtype over the optimizer's ranks:
    collective); None if none is sharded."""
    marked = [(k, sharding.held(v)) for k, v in enumerate(variables)]
    helds = [(k, held) for k, held in marked if held is not None]
    if not helds:
        return None
    built_with = _built_with(trackables, variables)  # (may raise: before the exchange)
    ordered = helds[0][1].ordered
    slots = tuple(
        Slot(
            k,
            held.pieces,
            tuple(int(d) for d in held.shape),
            tf.as_dtype(variables[k].dtype).as_numpy_dtype,
        )
        for k, held in helds
    )
    buddy: dict[int, np.ndarray] = {}
    for dtype in sorted({s.dtype for s in slots}, key=str):
        of_dtype = [s for s in slots if s.dtype == dtype]
        buddy.update(_exchange(ordered, of_dtype, arrays, dtype))
    return Copies(ordered.rank, ordered.size, slots, buddy, built_with)


def _exchange(
    ordered: OrderedComm, slots: Sequence[Slot], arrays: Sequence[Any], dtype: Any
) -> dict[int, np.ndarray]:
    """Sends this rank's pieces of ``slots`` to rank + 1; rank - 1's, by position."""
    mine = [_flat(arrays[s.position]) for s in slots if _piece(s, ordered.rank)]
    sent = np.concatenate(mine) if mine else np.zeros([0], dtype)
    splits = np.zeros([ordered.size], np.int64)
    splits[(ordered.rank + 1) % ordered.size] = sent.size
    received = ordered.alltoallv(tf.constant(sent), tf.constant(splits))[0].numpy()
    buddy, offset = {}, 0
    for slot in slots:
        piece = _piece(slot, (ordered.rank - 1) % ordered.size)
        if piece is not None:
            size = (piece.stop - piece.start) * slot.row_elements()
            buddy[slot.position] = received[offset : offset + size]
            offset += size
    return buddy


def _piece(slot: Slot, rank: int) -> sharding.Piece | None:
    return next((p for p in slot.pieces if p.rank == rank), None)


def _flat(array: Any) -> np.ndarray:
    return np.asarray(array).reshape(-1)


def restore(
    strategy: MPIStrategy,
    trackables: Sequence[Any],
    variables_now: Callable[[], Sequence[Any]],
    commit: tuple[Sequence[Any], Sequence[Any]],
    copies: Copies,
) -> None:
    """After a recovery (collective over the survivors, the strategy spanning
    them), or a join (the survivors and replacements, whose ``copies`` are
    ``newcomers_copies``): the sharded optimizers of ``trackables`` make their
    slots again for them, each over the variables it was built with
    (``copies.built_with``, among the ``commit``'s variables), after which
    ``variables_now()`` lists the state's variables, as the commit did; they
    are set to the commit's arrays (the optimizers' counts of their updates
    from their step counts: ``count_updates``), and each sharded slot is put
    together from the survivors that hold its pieces (their own or their lost
    buddy's) and cut for the ranks now. Raises ``ShardLostError`` on every survivor if
    a piece is on no survivor."""
    ordered = strategy.extended.ordered_comm
    was = ordered.allgather(tf.constant([copies.rank], tf.int64)).numpy().tolist()
    _check_recoverable(copies.size, was)
    committed, arrays = commit
    listed = optimizers(trackables)
    for k, positions in copies.built_with:
        built_with = [committed[p] for p in positions]
        sharded_optimizers.rebuild_slots(listed[k], strategy, built_with, positions)
    variables = variables_now()
    if len(variables) != len(arrays):
        raise MPIStrategyError(
            f"mpi_strategy.elastic: the state has {len(variables)} variables after its "
            f"sharded optimizers made their slots again, the commit {len(arrays)}."
        )
    slots = {slot.position: slot for slot in copies.slots}
    for k, (variable, array) in enumerate(zip(variables, arrays)):
        if k in slots:  # (one slot at a time: no rank holds more than one whole)
            whole = _put_together(ordered, slots[k], copies, was, array)
            sharded_optimizers.set_held(variable, whole)
        else:
            variable.assign(array)
    for optimizer in listed:
        sharded_optimizers.count_updates(optimizer)


def lost_shares(size: int, survivors: Sequence[int]) -> list[int]:
    """The ranks (of ``size``) whose share is on no survivor: lost with the
    next rank (mod ``size``), which held its copy."""
    lost = set(range(size)) - set(survivors)
    return sorted(r for r in lost if (r + 1) % size in lost)


def _check_recoverable(size: int, survivors: Sequence[int]) -> None:
    gone = lost_shares(size, survivors)
    if gone:
        lost = sorted(set(range(size)) - set(survivors))
        raise ShardLostError(
            f"mpi_strategy.elastic: ranks {lost} of the {size} of the last commit were lost. "
            f"The sharded optimizer's slots (MPIStrategy(shard=...)) of rank(s) {gone} were "
            "there and on the next rank (its copy), both lost: that optimizer state is gone. "
            "Resume from a checkpoint the program wrote (tf.train.Checkpoint, Keras' "
            "BackupAndRestore), or shard over ranks on different nodes, neighbours in rank "
            "order."
        )


def _put_together(
    ordered: OrderedComm, slot: Slot, copies: Copies, was: Sequence[int], own: Any
) -> np.ndarray:
    """The whole value of ``slot`` at the commit, on every survivor (one
    all-gather): the piece of rank r comes from r, or if r was lost from r + 1."""

    def provider(rank: int) -> int:
        return rank if rank in was else (rank + 1) % copies.size

    def provided_by(rank: int) -> list[sharding.Piece]:
        return [p for p in slot.pieces if provider(p.rank) == rank]

    mine = [
        _flat(own) if p.rank == copies.rank else copies.buddy[slot.position]
        for p in provided_by(copies.rank)
    ]
    sent = np.concatenate(mine) if mine else np.zeros([0], slot.dtype)
    gathered = ordered.allgather(tf.constant(sent)).numpy()
    whole = np.empty([int(np.prod(slot.shape))], slot.dtype)
    row, offset = slot.row_elements(), 0
    for rank in was:  # the survivors, in their new (= old) order
        for piece in provided_by(rank):
            size = (piece.stop - piece.start) * row
            whole[piece.start * row : piece.start * row + size] = gathered[offset : offset + size]
            offset += size
    return whole.reshape(slot.shape)
