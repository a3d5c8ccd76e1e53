"""A checkpoint of a sharded optimizer: each rank writes the slots it holds.

Under ``MPIStrategy(shard="optimizer")`` no rank holds the whole optimizer
state, and none gathers it: a ``TrackableSaver.save`` (every
``tf.train.Checkpoint`` save, write and ``CheckpointManager.save``) of objects
holding such slots is written in parts, then merged into TensorFlow's own
format, which restores anywhere (one process, a replicated run, a sharded run
at another world size):

1. The save runs as any write point (``calls.py``), against
   ``<prefix>_mpi_strategy_parts/part-00000``: rank 0 writes it (everything but
   the slots other ranks hold and the slots held in pieces, which are recorded
   in its object graph with no value), the others save in memory, noting the
   keys of the slots they hold.
2. Each rank writes the slots it holds that rank 0 did not write, the rows of
   a slot held in pieces as a slice of the whole, to its own ``rows-<rank>``.
3. The ranks meet (``PARTS``); rank 0 merges the parts into ``<prefix>``
   (``MergeV2Checkpoints``: one index, a data file per part; the slices of a
   slot become one tensor to every reader) and removes them.
4. The ranks meet again: the checkpoint is complete when the call returns.

The parts must be on one filesystem every rank sees: where ranks write to
node-local disks, every rank raises. ``tf.saved_model.save`` writes its
variables with a ``TrackableSaver`` too: a rank that writes the SavedModel
into an in-memory copy writes its part at the real path
(``write_point.real_path``). Inside ``tf.function`` no rank could write its
part: every rank raises as it traces the save.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from mpi_strategy._src import _tf_internal
from mpi_strategy._src.core import kinds
from mpi_strategy._src.core.errors import MPIStrategyError
from mpi_strategy._src.core.kinds import Kind
from mpi_strategy._src.distribute import sharding
from mpi_strategy._src.distribute.ordered_comm import OrderedComm
from mpi_strategy._src.features.saving import write_point

PARTS = kinds.register_kind(
    Kind(
        15,
        "the parts of a sharded optimizer's checkpoint",
        meeting=True,
        blame=(
            "A rank left a checkpoint of a sharded optimizer before the others: the save "
            "failed there (see that rank's own error), and the checkpoint is not complete."
        ),
    )
)
_PARTS_SUFFIX = "_mpi_strategy_parts"
_WHAT = "a sharded optimizer's checkpoint"


def save_in_parts_wrapper(save: Callable[..., Any]) -> Callable[..., Any]:
    """``TrackableSaver.save`` (already a write point): in parts (see the module)
    when what it saves holds slots of a sharded optimizer."""

    @functools.wraps(save)
    def save_in_parts(
        self: Any,
        file_prefix: Any,
        checkpoint_number: Any = None,
        session: Any = None,
        options: Any = None,
    ) -> Any:
        found = _sharded_ordered_comm(self, file_prefix)
        if found is None:
            return save(self, file_prefix, checkpoint_number, session, options)
        ordered, prefix = found
        if checkpoint_number:
            prefix = f"{prefix}-{int(checkpoint_number)}"
        _write_parts(save, self, ordered, prefix, options)
        return tf.constant(prefix)

    return save_in_parts


def _sharded_ordered_comm(saver: Any, file_prefix: Any) -> tuple[OrderedComm, str] | None:
    """The ordered communicator of the sharded MPIStrategy whose slots ``saver``
    saves, with every rank, and the real path it saves to (else None: saved as
    ever). A save into an in-memory copy of a write point (a rank that does not
    write ``tf.saved_model.save``'s files) writes its part at the real path.
    Raises inside ``tf.function``, where no rank could write its own part."""
    if not sharding.any_slots_marked():
        return None
    if not tf.executing_eagerly():
        if _ordered_comm_of_slots(saver) is not None:
            raise MPIStrategyError(
                f"mpi_strategy: {_WHAT} is being saved inside a tf.function (a "
                "tf.train.Checkpoint write there), where no rank can write the slots it "
                "holds. Call checkpoint.write or checkpoint.save on every rank outside "
                "tf.function, or save the model without its optimizer."
            )
        return None
    if (
        not isinstance(file_prefix, (str, os.PathLike))
        or write_point.role() == write_point.NOT_OURS
    ):
        return None
    prefix = os.fspath(file_prefix)
    if prefix.startswith("ram://"):
        prefix = write_point.real_path(prefix) or ""
    ordered = _ordered_comm_of_slots(saver) if prefix else None
    return None if ordered is None else (ordered, prefix)


def _ordered_comm_of_slots(saver: Any) -> OrderedComm | None:
    """The ordered communicator of the first sharded slot ``saver`` saves, or None."""
    for obj in tf.train.TrackableView(_tf_internal.saver_root(saver)).descendants():
        held = sharding.held(obj)
        if held is not None:
            return held.ordered
    return None


class _WhoWrites(_tf_internal.ShardByTaskPolicy):
    """TensorFlow's own sharding of a save, noting whether this rank writes
    the save itself (the callback runs inside the write point)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = False

    def __call__(self, shardable_tensors: Any) -> Any:
        self.writes = write_point.role() != write_point.IN_MEMORY
        return super().__call__(shardable_tensors)


def _held_here(saver: Any, rank: int) -> dict[str, tuple[Any, str]]:
    """The slots (and rows) this rank holds that rank 0's save does not
    write: checkpoint key -> (slot, its slice spec; "" for a whole tensor)."""
    held_here = {}
    for obj, key in _tf_internal.value_keys(saver):
        held = sharding.held(obj)
        if held is None or held.here is None or (held.whole_here and rank == 0):
            continue  # (rank 0's own save writes what rank 0 holds whole)
        spec = "" if held.whole_here else sharding.slice_spec(held.shape, held.here)
        held_here[key] = (obj, spec)
    return held_here


def _write_parts(
    save: Callable[..., Any], saver: Any, ordered: OrderedComm, prefix: str, options: Any
) -> None:
    if write_point.alone():
        raise MPIStrategyError(f"mpi_strategy: {_WHAT} {prefix} is saved by every rank together.")
    rank = ordered.rank
    parts = prefix + _PARTS_SUFFIX
    noted = _WhoWrites()
    options = copy.copy(options) if options is not None else tf.train.CheckpointOptions()
    if options.experimental_sharding_callback is not None:
        raise MPIStrategyError(
            "mpi_strategy: CheckpointOptions(experimental_sharding_callback=...) cannot be "
            "combined with MPIStrategy(shard='optimizer'), whose checkpoints are written "
            "in parts by the ranks that hold them."
        )
    options.experimental_sharding_callback = noted
    save(saver, os.path.join(parts, "part-00000"), None, None, options)
    held = _held_here(saver, rank)
    _then_meet(ordered, prefix, lambda: _write_own_part(noted.writes, held, parts, rank, prefix))
    _then_meet(ordered, prefix, lambda: _merge(parts, prefix) if rank == 0 else None)


def _then_meet(ordered: OrderedComm, prefix: str, action: Callable[[], None]) -> None:
    """Runs ``action``, then meets every rank: if it failed on any rank, every
    rank raises (and rank 0 removes the parts: a later save must not merge them)."""
    try:
        action()
    except Exception as exc:
        _meet(ordered, prefix, f"{type(exc).__name__}: {exc}")
        raise
    _meet(ordered, prefix, "")


def _meet(ordered: OrderedComm, prefix: str, failure: str) -> None:
    try:
        write_point.meet_after(ordered, _WHAT, prefix, failure, PARTS)
    except Exception:
        failure = failure or "on another rank"
        raise
    finally:
        if failure and ordered.rank == 0:
            _remove(prefix + _PARTS_SUFFIX)


def _write_own_part(
    writes: bool, held: dict[str, tuple[Any, str]], parts: str, rank: int, prefix: str
) -> None:
    """Each rank writes the slots (and rows) it holds that rank 0's save did not write."""
    if writes and rank != 0:
        raise MPIStrategyError(
            f"mpi_strategy: rank {rank} writes its own copy of {prefix} (node-local "
            "disks?); a sharded optimizer's checkpoint needs one filesystem every rank sees."
        )
    if held:
        keys = sorted(held)
        tf.io.gfile.makedirs(parts)  # (rank 0 may not have made it yet)
        tf.raw_ops.SaveV2(
            prefix=os.path.join(parts, f"rows-{rank:05d}"),
            tensor_names=keys,
            shape_and_slices=[held[k][1] for k in keys],
            tensors=[tf.convert_to_tensor(_variable(held[k][0])) for k in keys],
        )


def _variable(slot: Any) -> Any:
    """A slot's TensorFlow variable (a tf_keras slot is one; a Keras 3 slot holds one)."""
    return slot if isinstance(slot, tf.Variable) else slot.value


def _merge(parts: str, prefix: str) -> None:
    """The parts in ``parts`` merged into the checkpoint ``prefix`` (then removed)."""
    written = sorted(
        f"{parts}/{name[: -len('.index')]}"
        for name in tf.io.gfile.listdir(parts)
        if name.endswith(".index")
    )
    tf.raw_ops.MergeV2Checkpoints(
        checkpoint_prefixes=written, destination_prefix=prefix, delete_old_dirs=False
    )
    _remove(parts)


def _remove(parts: str) -> None:
    if tf.io.gfile.exists(parts):
        tf.io.gfile.rmtree(parts)
