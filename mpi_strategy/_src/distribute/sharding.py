"""Sharded optimizer state and gradients (ZeRO stages 1 and 2): the mechanism,
framework-free of Keras.

With ``MPIStrategy(shard="optimizer")`` each rank keeps the optimizer's
per-variable state (its *slots*: Adam's moments, momentum, ...) only for its
share of the variables (whole variables, and rows of the few that straddle a
share's end), updates only that share from the all-reduced gradients, and the
ranks then all-gather the updated variables. ``shard="gradients"`` sums the
gradients with a reduce-scatter instead: each rank receives the sum of its
share's rows only (``scatter_pieces``). The pieces:

* ``partition``: which rank holds which rows of which variable, in equal
  bytes, the same on every rank (the variables come in the same order);
  ``partition_whole`` the same with every variable whole;
* ``SlotPlaceholder``: what stands for a slot this rank holds none of (no
  data; a sharded save records it and writes nothing for it, a SavedModel
  records its whole shape, restores skip it, reads raise), and
  ``rows_creator`` for a slot of some rows;
* ``scatter_pieces``: one reduce-scatter of the gradients, each rank getting its rows;
* ``gather_pieces``: one all-gather of every rank's rows, put back together.

``features/sharding.py`` decides, per Keras optimizer, when each is used.
"""

from __future__ import annotations

import contextlib
import math
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
from mpi_strategy._src.distribute.engines import unknown_to_grappler
from mpi_strategy._src.distribute.fusion import wire_dtype
from mpi_strategy._src.distribute.ordered_comm import OrderedComm

MODES = (None, "optimizer", "gradients")


def resolve(shard: str | None) -> str | None:
    """``shard`` checked (the same on every rank: it is the program's)."""
    if shard not in MODES:
        raise MPIStrategyError(
            f"mpi_strategy: MPIStrategy(shard={shard!r}): expected one of {list(MODES)}."
        )
    return shard


class Piece(NamedTuple):
    """Rows ``start`` .. ``stop`` of a variable (its first axis), held by ``rank``."""

    rank: int
    start: int
    stop: int


def partition(units: Sequence[tuple[int, int]], size: int) -> list[tuple[Piece, ...]]:
    """The pieces of each unit ``(rows, bytes per row)``, in the order given.

    The units laid end to end are cut in ``size`` runs of (as nearly as whole
    rows allow) equal bytes, rank r holding the r-th: no rank holds more than
    total/size + the bytes between two possible cuts. Only a unit that straddles a cut is split (at
    most size - 1 of them); every other unit is held whole by one rank. Cuts
    fall on 64-byte boundaries of the unit: a piece's elements take the same
    SIMD lanes as in the whole, so an elementwise update of it gives the same
    bits. (A unit of 1 row is never cut.)
    """
    total = sum(rows * per_row for rows, per_row in units) or 1
    pieces: list[tuple[Piece, ...]] = []
    offset = 0
    for rows, per_row in units:
        if rows * per_row == 0:  # (no bytes: held whole by the rank whose run it is in)
            pieces.append((Piece(min(size - 1, offset * size // total), 0, rows),))
            continue
        granule = _CUT_BYTES // math.gcd(_CUT_BYTES, per_row)  # rows between possible cuts
        cuts = [0]
        for rank in range(1, size):  # where rank's run starts, in this unit's rows
            row = (rank * total / size - offset) / per_row
            inside = 0 < row < rows  # (else the unit is before or after that start)
            cuts.append(
                min(rows, round(row / granule) * granule)
                if inside
                else max(0, min(rows, math.ceil(row)))
            )
        cuts.append(rows)
        pieces.append(
            tuple(Piece(r, cuts[r], cuts[r + 1]) for r in range(size) if cuts[r + 1] > cuts[r])
        )
        offset += rows * per_row
    return pieces


_CUT_BYTES = 64  # the widest SIMD register (AVX-512), and TensorFlow's buffer alignment


def partition_whole(units: Sequence[tuple[int, int]], size: int) -> list[tuple[Piece, ...]]:
    """As ``partition``, with no unit cut (for an update that reads a whole
    variable): each unit is held whole by the rank in whose run of total/size
    bytes its middle byte falls, so no rank holds more than total/size + the
    largest unit (half of one at each end of its run)."""
    total = sum(rows * per_row for rows, per_row in units) or 1
    pieces: list[tuple[Piece, ...]] = []
    offset = 0
    for rows, per_row in units:
        middle_twice = 2 * offset + rows * per_row  # (in half bytes: exact)
        pieces.append((Piece(min(size - 1, middle_twice * size // (2 * total)), 0, rows),))
        offset += rows * per_row
    return pieces


def check_same_partition(ordered: OrderedComm, pieces: Sequence[tuple[Piece, ...]]) -> None:
    """Makes the next collective raise on every rank if ranks partitioned
    differently (checked now, eagerly: a graph being traced may be dropped,
    as tf.function drops the trace that created the variables)."""
    digest = zlib.crc32(repr(list(pieces)).encode())
    with tf.init_scope():
        ordered.check_same_constants([np.array([digest], np.uint32)])


class SlotPlaceholder(_tf_internal.ResourceVariable):
    """A slot that rank ``owner`` holds: no data here (shape [0]).

    In a checkpoint it is recorded as a value of ``full_shape`` that this rank
    does not write (the owner writes it); a restore skips it; reading or
    assigning it raises (a code path that would train on it must not)."""

    def __init__(
        self, full_shape: tf.TensorShape, dtype: tf.DType, held_by: str, name: str
    ) -> None:
        super().__init__(
            initial_value=tf.zeros([0], dtype), trainable=False, name=name, dtype=dtype
        )
        self.full_shape = tf.TensorShape(full_shape)
        self.held_by = held_by
        _tf_internal.record_shape_in_saved_model(self, self.full_shape)

    def _refuse(self, *_: Any, **__: Any) -> Any:
        raise MPIStrategyError(
            f"mpi_strategy: optimizer slot {self.name} of shape {self.full_shape} lives on "
            f"{self.held_by} (MPIStrategy(shard=...)); this rank holds none of it."
        )

    numpy = _refuse

    def value(self) -> Any:
        """Refused; inside ``reading_placeholders_as_empty``, no rows."""
        if not getattr(_local, "empty", False):
            return self._refuse()
        rest = self.full_shape[1:] if self.full_shape.rank else []
        return tf.zeros([0, *rest], self.dtype)

    read_value = value

    def assign(self, *_: Any, **__: Any) -> Any:
        """Refused; inside ``reading_placeholders_as_empty``, nothing."""
        return tf.no_op() if getattr(_local, "empty", False) else self._refuse()

    assign_add = assign_sub = assign

    def __repr__(self) -> str:
        return f"<SlotPlaceholder {self.name} shape={self.full_shape} on {self.held_by}>"

    def _serialize_to_tensors(self) -> dict[str, Any]:
        return _recorded_only(self.dtype, self.device)

    def _restore_from_tensors(self, restored_tensors: Any) -> Any:
        return tf.no_op()


def rows_creator(piece: Piece, full_shape: tf.TensorShape) -> Callable[..., Any]:
    """A ``tf.variable_creator_scope`` creator of a slot holding ``piece``'s
    rows of a slot of ``full_shape``: recorded in a checkpoint with no value
    (its rank writes the rows itself, as a slice of the whole: ``slice_spec``),
    and in a SavedModel as a variable of ``full_shape``; restored from the rows
    of the whole value. (Set on the variable as it is made: a restore that
    waits for it runs as soon as the optimizer tracks it.)"""

    def create(next_creator: Any, **kwargs: Any) -> Any:
        variable = next_creator(**kwargs)
        dtype = tf.as_dtype(variable.dtype)

        def serialize() -> dict[str, Any]:
            return _recorded_only(dtype, variable.device)

        def restore(restored_tensors: Any) -> Any:
            whole = restored_tensors[_tf_internal.VARIABLE_VALUE_KEY]
            return variable.assign(whole[piece.start : piece.stop])

        object.__setattr__(variable, "_serialize_to_tensors", serialize)
        object.__setattr__(variable, "_restore_from_tensors", restore)
        _tf_internal.record_shape_in_saved_model(variable, full_shape)
        return variable

    return create


def _recorded_only(dtype: tf.DType, device: str) -> dict[str, Any]:
    """A slot's checkpoint value: None (in the object graph, in no file of
    this rank: in a save in parts, the ranks write their rows themselves)."""
    spec = _tf_internal.SaveSpec(lambda: None, "", "", dtype=dtype, device=device)
    return {_tf_internal.VARIABLE_VALUE_KEY: spec}


def slice_spec(full_shape: tf.TensorShape, piece: Piece) -> str:
    """TensorFlow's name of ``piece``'s rows of a tensor of ``full_shape``
    (``tf.Variable.SaveSliceInfo.spec``): "4 3 2,2:-" for rows 2-3 of 4 x 3."""
    rest = ["-"] * (len(full_shape) - 1)
    dims = " ".join(str(int(d)) for d in full_shape)
    return f"{dims} {':'.join([f'{piece.start},{piece.stop - piece.start}', *rest])}"


def placeholder_creator(full_shape: Any, held_by: str) -> Callable[..., SlotPlaceholder]:
    """A ``tf.variable_creator_scope`` creator that makes ``SlotPlaceholder``s
    of slots of ``full_shape`` held by ``held_by`` (e.g. "rank 1"; the
    requested initial value is never computed)."""

    def create(next_creator: Any, **kwargs: Any) -> SlotPlaceholder:
        del next_creator
        dtype = tf.as_dtype(kwargs.get("dtype") or tf.float32)
        with tf.init_scope():
            return SlotPlaceholder(full_shape, dtype, held_by, kwargs.get("name") or "slot")

    return create


_local = threading.local()


def slots_start_alike() -> contextlib.AbstractContextManager[None]:
    """Variables created in the block are slots with a constant initializer,
    which starts them alike on every rank without rank 0's broadcast (only
    their owner creates them: a broadcast would be a collective of one)."""
    return _set_in_thread("alike")


def reading_placeholders_as_empty() -> contextlib.AbstractContextManager[None]:
    """Inside the block a ``SlotPlaceholder`` reads as no rows (a tensor of 0
    rows of its rows' shape) and ignores writes: an optimizer's update of no
    rows (``features/sharding``: tf_keras's Nadam, whose update also advances
    state outside its slots) runs on a rank that holds none of them."""
    return _set_in_thread("empty")


@contextlib.contextmanager
def _set_in_thread(flag: str) -> Iterator[None]:
    previous = getattr(_local, flag, False)
    setattr(_local, flag, True)
    try:
        yield
    finally:
        setattr(_local, flag, previous)


def starting_alike() -> bool:
    """True inside ``slots_start_alike``."""
    return getattr(_local, "alike", False)


def gather_pieces(
    ordered: OrderedComm,
    shapes: Sequence[tf.TensorShape],
    dtypes: Sequence[tf.DType],
    pieces: Sequence[tuple[Piece, ...]],
    mine: dict[int, tf.Tensor],
    timeout: float | None = None,
) -> list[tf.Tensor | None]:
    """Every variable whole, on every rank, from its ``pieces``: one all-gather
    of each rank's pieces (``mine``: variable index -> this rank's rows;
    flattened, one tensor per dtype). None for a variable this rank holds whole.
    The variables come in the order the partition was made in (or a subset of
    it), so that rank r's pieces all come before rank r + 1's."""
    kinds = sorted(set(dtypes), key=lambda d: d.name)
    flat = {d: [tf.reshape(mine[i], [-1]) for i in sorted(mine) if dtypes[i] == d] for d in kinds}
    sent = [tf.concat(flat[d], 0) if flat[d] else tf.zeros([0], d) for d in kinds]
    gathered = dict(zip(kinds, ordered.allgather_many(sent, timeout)))
    values: list[tf.Tensor | None] = [None] * len(shapes)
    for d in kinds:
        members = [i for i in range(len(shapes)) if dtypes[i] == d]
        _check_in_partition_order([pieces[i] for i in members])
        sizes = [_row_elements(shapes[i]) * rows_of(shapes[i]) for i in members]
        # The ranks' runs in rank order are the variables in build order:
        # each variable is a slice of what was gathered, no copy.
        for i, start, size in zip(members, np.cumsum([0, *sizes]), sizes):
            values[i] = tf.reshape(gathered[d][int(start) : int(start + size)], shapes[i])
    for i in range(len(shapes)):
        if pieces[i] == (Piece(ordered.rank, 0, pieces[i][-1].stop),):
            values[i] = None  # (held whole here)
    return values


def scatter_pieces(
    ordered: OrderedComm,
    values: Sequence[tf.Tensor],
    shapes: Sequence[tf.TensorShape],
    pieces: Sequence[tuple[Piece, ...]],
    timeout: float | None = None,
) -> dict[int, tf.Tensor]:
    """This rank's rows of each of ``values`` (this rank's dense gradients, of
    its variables' ``shapes``), summed over the ranks: {index: rows} for each
    value this rank holds a piece of. One reduce-scatter per wire dtype: each rank's pieces laid end
    to end, in the order given (the same on every rank), padded with zeros to
    the longest rank's, as FSDP pads its flat parameter, so that every rank
    receives one row. (Shares are equal in bytes over all dtypes: the padding
    is small for one dtype and variables of many rows, and up to a variable's
    size where one of few rows is not cut.) ``timeout``: as the strategy's."""
    mine: dict[int, tf.Tensor] = {}
    values = [tf.reshape(v, s) for v, s in zip(values, shapes)]  # (static shapes)
    by_dtype: dict[tf.DType, list[int]] = {}
    for i, value in enumerate(values):
        by_dtype.setdefault(wire_dtype(value.dtype), []).append(i)
    for dtype, members in by_dtype.items():
        segments = [
            [(i, p) for i in members for p in pieces[i] if p.rank == r] for r in range(ordered.size)
        ]
        lengths = [[_piece_elements(values[i].shape, p) for i, p in seg] for seg in segments]
        longest = max(sum(n) for n in lengths)
        flat = []
        for seg, n in zip(segments, lengths):
            flat += [tf.reshape(tf.cast(_rows(values[i], p), dtype), [-1]) for i, p in seg]
            flat.append(tf.zeros([longest - sum(n)], dtype))
        packed = tf.reshape(tf.concat(flat, 0), [ordered.size, longest])
        summed = ordered.reducescatter(packed, timeout=timeout)
        own, sizes = segments[ordered.rank], lengths[ordered.rank]
        for (i, p), part in zip(own, tf.split(summed[0, : sum(sizes)], sizes) if own else []):
            whole = p.start == 0 and p.stop == rows_of(values[i].shape)
            shape = values[i].shape if whole else [p.stop - p.start, *values[i].shape[1:]]
            mine[i] = unknown_to_grappler(tf.cast(tf.reshape(part, shape), values[i].dtype))
    return mine


def _rows(value: tf.Tensor, piece: Piece) -> tf.Tensor:
    """``piece``'s rows of ``value`` (a scalar is one row)."""
    return value[piece.start : piece.stop] if value.shape.rank else tf.reshape(value, [1])


def _piece_elements(shape: tf.TensorShape, piece: Piece) -> int:
    return (piece.stop - piece.start) * _row_elements(tf.TensorShape(shape))


def _check_in_partition_order(pieces: Sequence[tuple[Piece, ...]]) -> None:
    """Raises unless rank r's pieces all come before rank r + 1's (e.g. a
    variable given twice to one apply_gradients)."""
    ranks = [p.rank for cut in pieces for p in cut]
    if ranks != sorted(ranks):
        raise MPIStrategyError(
            "mpi_strategy: a sharded optimizer's step got its variables out of the order it "
            "was built with, or one variable twice (in one apply_gradients call): each "
            "variable once, please."
        )


def rows_of(shape: tf.TensorShape) -> int:
    """The rows a variable of ``shape`` is cut in: its first axis (a scalar: 1)."""
    return int(shape[0]) if shape.rank else 1


def _row_elements(shape: tf.TensorShape) -> int:
    return int(np.prod(shape[1:])) if shape.rank else 1


class Held(NamedTuple):
    """Where a sharded optimizer's slot of ``shape`` is: its ``pieces`` over
    the ranks of ``ordered``."""

    pieces: tuple[Piece, ...]
    ordered: OrderedComm
    shape: tf.TensorShape

    @property
    def here(self) -> Piece | None:
        """This rank's piece, or None."""
        return next((p for p in self.pieces if p.rank == self.ordered.rank), None)

    @property
    def whole_here(self) -> bool:
        """True if this rank holds all of it."""
        return len(self.pieces) == 1 and self.pieces[0].rank == self.ordered.rank

    def ranks(self) -> str:
        """Who holds it, e.g. "rank 1" or "ranks 0, 1"."""
        ranks = [str(p.rank) for p in self.pieces]
        return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}"


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


def any_slots_marked() -> bool:
    """False until this process made a sharded optimizer's slot."""
    return PROCESS.of(ShardingState).slots_marked > 0


def held(obj: Any) -> Held | None:
    """Where ``obj`` is held if it is a sharded optimizer's slot, else None."""
    found = getattr(obj, _HELD, None)
    return found if isinstance(found, Held) else None
