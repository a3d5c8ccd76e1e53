"""A checkpoint of a sharded optimizer: each rank writes the slots it holds.

Under ``MPIStrategy(shard="optimizer")`` no rank holds the whole optimizer
state, and none gathers it: a ``TrackableSaver.save`` (every
``tf.train.Checkpoint`` save, write and ``CheckpointManager.save``) of objects
holding such slots is written in parts, then merged into TensorFlow's own
format, which restores anywhere (one process, a replicated run, a sharded run
at another world size):

1. The save runs as any write point (``calls.py``), against
   ``<prefix>_mpi_strategy_parts/part-00000``: rank 0 writes it (everything but
   the slots other ranks hold, which are recorded in its object graph with no
   value), the others save in memory, noting the keys of the slots they hold.
2. Each other rank holding slots writes them to its own ``part-<rank>``.
3. The ranks meet (``PARTS``); rank 0 merges the parts into ``<prefix>``
   (``MergeV2Checkpoints``: one index, a data file per part) and removes them.
4. The ranks meet again: the checkpoint is complete when the call returns.

The parts must be on one filesystem every rank sees: where ranks write to
node-local disks, every rank raises.
"""

from __future__ import annotations

import copy
import functools
import os
import shutil
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
        ordered = _sharded_ordered_comm(self, file_prefix)
        if ordered is None:
            return save(self, file_prefix, checkpoint_number, session, options)
        prefix = os.fspath(file_prefix)
        if checkpoint_number:
            prefix = f"{prefix}-{int(checkpoint_number)}"
        _write_parts(save, self, ordered, prefix, options)
        return tf.constant(prefix)

    return save_in_parts


def _sharded_ordered_comm(saver: Any, file_prefix: Any) -> OrderedComm | None:
    """The ordered communicator of the sharded MPIStrategy whose slots ``saver``
    saves to a real path, eagerly, with every rank (else None: saved as ever)."""
    if (
        not sharding.any_slots_marked()
        or not isinstance(file_prefix, (str, os.PathLike))
        or os.fspath(file_prefix).startswith("ram://")
        or not tf.executing_eagerly()
        or write_point.role() == write_point.NOT_OURS
    ):
        return None
    for obj in tf.train.TrackableView(_tf_internal.saver_root(saver)).descendants():
        held = sharding.held(obj)
        if held is not None:
            return held.ordered
    return None


class _SlotsHeldHere(_tf_internal.ShardByTaskPolicy):
    """TensorFlow's own sharding of a save, noting the checkpoint keys of the
    slots this rank holds, and whether this rank writes the save itself."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.held: dict[str, Any] = {}
        self.writes = False

    def __call__(self, shardable_tensors: Any) -> Any:
        self.writes = write_point.role() not in (write_point.IN_MEMORY,)
        for tensor in shardable_tensors:
            held = sharding.held(tensor.trackable)
            if held is not None and held.owner == self.rank:
                self.held[tensor.checkpoint_key] = tensor.trackable
        return super().__call__(shardable_tensors)


def _write_parts(
    save: Callable[..., Any], saver: Any, ordered: OrderedComm, prefix: str, options: Any
) -> None:
    rank = ordered.rank
    parts = prefix + _PARTS_SUFFIX
    noted = _SlotsHeldHere(rank)
    options = copy.copy(options) if options is not None else tf.train.CheckpointOptions()
    if options.experimental_sharding_callback is not None:
        raise MPIStrategyError(
            "mpi_strategy: CheckpointOptions(experimental_sharding_callback=...) cannot be "
            "combined with MPIStrategy(shard='optimizer'), whose checkpoints are written "
            "in parts by the ranks that hold them."
        )
    options.experimental_sharding_callback = noted
    save(saver, os.path.join(parts, "part-00000"), None, None, options)
    _then_meet(ordered, prefix, lambda: _write_own_part(noted, parts, rank, prefix))
    _then_meet(ordered, prefix, lambda: _merge(parts, prefix) if rank == 0 else None)


def _then_meet(ordered: OrderedComm, prefix: str, action: Callable[[], None]) -> None:
    """Runs ``action``, then meets every rank: if it failed on any rank, every rank raises."""
    try:
        action()
    except Exception as exc:
        write_point.meet_after(ordered, _WHAT, prefix, f"{type(exc).__name__}: {exc}", PARTS)
        raise
    write_point.meet_after(ordered, _WHAT, prefix, "", PARTS)


def _write_own_part(noted: _SlotsHeldHere, parts: str, rank: int, prefix: str) -> None:
    """Ranks other than 0 write the slots they hold to their own part."""
    if noted.writes and rank != 0:
        raise MPIStrategyError(
            f"mpi_strategy: rank {rank} writes its own copy of {prefix} (node-local "
            "disks?); a sharded optimizer's checkpoint needs one filesystem every rank sees."
        )
    if noted.held and rank != 0:
        keys = sorted(noted.held)
        tf.raw_ops.SaveV2(
            prefix=os.path.join(parts, f"part-{rank:05d}"),
            tensor_names=keys,
            shape_and_slices=[""] * len(keys),
            tensors=[tf.convert_to_tensor(noted.held[k].value) for k in keys],
        )


def _merge(parts: str, prefix: str) -> None:
    """The parts in ``parts`` merged into the checkpoint ``prefix`` (then removed)."""
    written = sorted(
        os.path.join(parts, name[: -len(".index")])
        for name in os.listdir(parts)
        if name.endswith(".index")
    )
    tf.raw_ops.MergeV2Checkpoints(
        checkpoint_prefixes=written, destination_prefix=prefix, delete_old_dirs=False
    )
    shutil.rmtree(parts, ignore_errors=True)
