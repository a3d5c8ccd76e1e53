"""What survives a lost rank: ``State`` and its commits, in memory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from mpi_strategy._src.core.errors import MPIStrategyError
from mpi_strategy._src.core.process import PROCESS
from mpi_strategy._src.features import sharding as sharded_optimizers
from mpi_strategy._src.features.elastic import sharded

_COMMITS_KEPT = 2  # a rank may have committed once more than a survivor that was cut short
# (number, values, arrays, sharded slots): a commit as sent to a replacement, the
# array of a sharded slot None (see ``newest``)
Newest = tuple[int, dict[str, Any], list[np.ndarray | None], sharded.Copies | None]


class State:
    """What survives a lost rank: variables (of models, optimizers, or
    ``tf.Variable``s) and named Python values (``state.step``, ``state.epoch``).

    ``commit()`` copies them, in memory, on every rank (no communication: they
    are the same on every rank; but the slots of a sharded optimizer,
    ``MPIStrategy(shard=...)``, differ: each rank also keeps a copy of its
    neighbour's, ``sharded.py``). The values are attributes: ``state.step += 1``.
    """

    def __init__(self, *trackables: Any, **values: Any) -> None:
        object.__setattr__(self, "_trackables", trackables)
        object.__setattr__(self, "_values", dict(values))
        # (number, (variables, arrays), values, sharded.Copies or None), newest last; the
        # array of a sharded slot this rank holds none of is None
        object.__setattr__(self, "_commits", [])
        object.__setattr__(self, "_number", 0)
        object.__setattr__(self, "_on_commit", None)  # run()'s replacements join here

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self._values[name] = value

    def commit(self) -> None:
        """Copies the variables and values; every rank must commit at the same steps
        (with a sharded optimizer, a commit is collective: ``sharded.copy_to_buddy``)."""
        # Listed at every commit: optimizers create their slots at the first step.
        variables = variables_of(self._trackables)
        sharded.check_supported(self._trackables)  # (on every rank, at the first commit)
        arrays = _read(variables)
        copies = sharded.copy_to_buddy(self._trackables, variables, arrays)
        object.__setattr__(self, "_number", self._number + 1)
        self._commits.append((self._number, (variables, arrays), dict(self._values), copies))
        del self._commits[:-_COMMITS_KEPT]
        if self._on_commit is not None:
            self._on_commit()

    @property
    def commit_number(self) -> int:
        """How many commits this rank made (the newest commit's number)."""
        return self._commits[-1][0] if self._commits else 0

    def restore(self, number: int | None = None) -> None:
        """Sets the variables and values back to commit ``number`` (default: the
        newest), on a rank of the world that made it (after a recovery, ``run``
        puts a sharded optimizer's slots together: ``sharded.restore``)."""
        _, (variables, arrays), _, _ = commit_of(self, number)
        for variable, value in zip(variables, arrays):
            if value is not None:  # (a sharded slot another rank holds)
                variable.assign(value)
        for t in self._trackables:
            sharded_optimizers.count_updates(t)
        roll_back_values(self, number)


# -- what the rest of elastic training reads and sets (named, not reached into) --
Commit = tuple[int, tuple[list[Any], list[Any]], dict[str, Any], Any]


def commit_of(state: State, number: int | None) -> Commit:
    """Commit ``number`` (None: the newest); raises if this rank holds none of that number."""
    matching = [c for c in state._commits if number is None or c[0] == number]
    if not matching:
        raise MPIStrategyError(
            f"mpi_strategy.elastic: commit #{number} is not held here (held: "
            f"{[c[0] for c in state._commits]})."
        )
    return matching[-1]


def roll_back_values(state: State, number: int | None) -> None:
    """Sets the values back to commit ``number``'s and drops the commits after it."""
    number, _, values, _ = commit_of(state, number)
    state._values.clear()
    state._values.update(values)
    object.__setattr__(state, "_number", number)
    del state._commits[[c[0] for c in state._commits].index(number) + 1 :]


def trackables_of(state: State) -> tuple[Any, ...]:
    """The models, optimizers and variables ``state`` was built with."""
    return state._trackables


def values_of(state: State) -> dict[str, Any]:
    """``state``'s named values, as they are now (the dict itself)."""
    return state._values


def on_commit(state: State, callback: Callable[[], None] | None) -> None:
    """Calls ``callback()`` after each of ``state``'s commits (None: nothing)."""
    object.__setattr__(state, "_on_commit", callback)


def resume(state: State, values: dict[str, Any], number: int) -> None:
    """Makes ``values`` and commit number ``number`` (of an earlier launch) the
    state's; its variables are set by the caller. Commits them."""
    state._values.update(values)
    object.__setattr__(state, "_number", number - 1)
    state.commit()


def newest(state: State) -> Newest:
    """(number, values, arrays, sharded.Copies or None) of the newest commit, to
    send to a replacement: the array of a sharded slot is None (this rank holds a
    piece of it at most; the ranks put it together after the join: ``sharded.restore``)."""
    # (np.asarray: a replacement's first commit holds the arrays it received)
    number, (_, tensors), values, copies = state._commits[-1]
    elsewhere = {slot.position for slot in copies.slots} if copies else set()
    arrays = [None if k in elsewhere else np.asarray(t) for k, t in enumerate(tensors)]
    return number, values, arrays, copies


def specs(state: State) -> list[tuple[tuple[int, ...], Any]]:
    """(shape, numpy dtype) of each variable, as ``newest()`` lists them."""
    return [
        (tuple(v.shape), tf.as_dtype(v.dtype).as_numpy_dtype)
        for v in variables_of(state._trackables)
    ]


def hold(state: State, commit: Newest) -> None:
    """Makes ``commit`` (the survivors' ``newest()``, in a replacement) the
    state's only commit, and its values the state's; sets no variable
    (``State.restore`` does) and does not communicate."""
    number, values, arrays, copies = commit
    variables = variables_of(state._trackables)
    state._values.clear()
    state._values.update(values)
    object.__setattr__(state, "_number", number)
    state._commits[:] = [(number, (variables, arrays), dict(values), copies)]


def variables_of(trackables: tuple[Any, ...]) -> list[tf.Variable]:
    """Every variable of ``trackables`` (models, optimizers, variables), in order."""
    variables = []
    for t in trackables:
        if isinstance(t, tf.Variable):
            variables.append(t)
        else:
            found = getattr(t, "variables", None)
            found = found() if callable(found) else found
            if found is None:
                raise TypeError(f"mpi_strategy.elastic.State: {t!r} has no variables.")
            variables.extend(found)
            variables.extend(sharded_optimizers.outside_variables(t))
    return variables


def _read(variables: list[tf.Variable]) -> list[tf.Tensor | None]:
    """Snapshots of the variables' values in host memory (not an accelerator's;
    None for a sharded slot this rank holds none of), read in one traced
    function rather than one eager read per distributed variable, whose fixed
    cost would dominate a small model's commit. The tensors are immutable: a
    later update of a variable on the host copies its buffer first (copy on
    write), so no copy is made here for CPU variables."""
    held = [v for v in variables if not sharded.held_elsewhere(v)]
    read = dict(zip(map(id, held), _read_held(held)))
    return [read.get(id(v)) for v in variables]


def _read_held(variables: list[tf.Variable]) -> list[tf.Tensor]:
    key = tuple(id(v) for v in variables)
    if _state().reader_key != key:

        def read_all() -> list[tf.Tensor]:
            with tf.device("/device:CPU:0"):
                return [tf.identity(v) for v in variables]

        # Called as a concrete function: skips tf.function's argument matching,
        # a large part of a small commit's call.
        read = tf.function(read_all, autograph=False)
        _state().reader_key, _state().reader = key, read.get_concrete_function()
    return _state().reader()


# The newest state's reader (traced once) and the variables it reads.


@dataclass
class ReaderState:
    """The traced reader of the state's variables, and what it was traced for (``PROCESS.of``)."""

    reader_key: Any = None
    reader: Any = None


def _state() -> ReaderState:
    return PROCESS.of(ReaderState)
