"""Horovod's helpers over the collectives: variables and Python objects."""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import tensorflow as tf

from mpi_strategy._src.core.collectives import ArrayCollectives
from mpi_strategy._src.horovod import basics
from mpi_strategy._src.horovod.basics import ProcessSet, global_process_set
from mpi_strategy._src.horovod.mpi_ops import broadcast_


def broadcast_variables(
    variables: Iterable[tf.Variable],
    root_rank: int,
    process_set: ProcessSet = global_process_set,
    inplace: bool = False,
) -> list[tf.Tensor]:
    """Assigns every variable its value on ``root_rank`` (every rank of the set calls it)."""
    return broadcast_(list(variables), root_rank, process_set=process_set)


def broadcast_global_variables(root_rank: int) -> None:
    """TensorFlow 1's global variables: there are none in eager mode (Horovod
    raises the same RuntimeError); use ``broadcast_variables``."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution. "
            "Please use `hvd.broadcast_variables(<model/optimizer variables>)` instead."
        )
    broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    session: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """``obj`` as it is on ``root_rank`` (pickled there), on every rank of the set."""
    collectives = _collectives(process_set)
    mine = process_set.rank() == root_rank
    data = _pickled(obj) if mine else np.zeros(0, np.uint8)
    length = collectives.broadcast(np.array([data.size], np.int64), root_rank)
    if not mine:
        data = np.zeros(int(length[0]), np.uint8)
    received = collectives.broadcast(data, root_rank)
    return obj if mine else pickle.loads(received.tobytes())


def broadcast_object_fn(
    root_rank: int = 0,
    session: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Callable[[Any], Any]:
    """A function that broadcasts its argument from ``root_rank`` (``broadcast_object``)."""
    return lambda obj: broadcast_object(obj, root_rank, process_set=process_set)


def allgather_object(
    obj: Any,
    session: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[Any]:
    """Every rank's ``obj`` (pickled), in rank order, on every rank of the set."""
    collectives = _collectives(process_set)
    data = _pickled(obj)
    lengths, gathered = collectives.allgather([np.array([data.size], np.int64), data])
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return [pickle.loads(gathered[a:b].tobytes()) for a, b in itertools.pairwise(starts)]


class _Direct:
    """The set's collectives called right away from Python (as Horovod's object
    helpers run theirs), a lost rank raised as ``RanksLostError``. Eager ops
    have all run by then; no TensorFlow op is involved, so this works in a
    TensorFlow 1 graph too."""

    def __init__(self, collectives: ArrayCollectives) -> None:
        self._collectives = collectives

    def broadcast(self, array: np.ndarray, root: int) -> np.ndarray:
        result: np.ndarray = self._collectives.guarded(self._collectives.broadcast)(array, root)
        return result

    def allgather(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        result: list[np.ndarray] = self._collectives.guarded(self._collectives.allgather)(arrays)
        return result


def _collectives(process_set: ProcessSet) -> _Direct:
    basics.check_initialized("an object collective")
    return _Direct(process_set.comm().collectives)


def _pickled(obj: Any) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj), np.uint8).copy()
