"""The state on disk: saved when too few ranks survive, resumed by a relaunch."""

from __future__ import annotations

import json
import os
from typing import Any

import tensorflow as tf

from mpi_strategy._src.core.logs import logger
from mpi_strategy._src.distribute.strategy import MPIStrategy
from mpi_strategy._src.features.elastic import state as state_lib
from mpi_strategy._src.features.elastic.state import State
from mpi_strategy._src.features.saving import write_point

_PREFIX = "state"  # the checkpoint's name in run()'s directory


def resume_if_saved(state: State, directory: str) -> bool:
    """Loads the state that an earlier launch saved in ``directory`` (and
    commits it) if there is one; True if it did."""
    prefix = os.path.join(directory, _PREFIX)
    if not tf.io.gfile.exists(prefix + ".index"):
        return False
    values = tf.Variable("")
    _checkpoint(state, values).read(prefix).assert_consumed()
    record = json.loads(values.numpy().decode())
    logger.warning(
        "mpi_strategy.elastic: resuming from the state saved in %s (commit "
        "#%d of an earlier launch on %d rank(s): %s)",
        os.path.abspath(directory),
        record["commit"],
        record["ranks"],
        describe(record["values"]),
    )
    state_lib.resume(state, record["values"], record["commit"])
    return True


def save(strategy: MPIStrategy, state: State, directory: str) -> None:
    """Writes the variables and values as they are now (every rank calls it:
    the checkpoint's write is a write point, one writer per filesystem)."""
    record = {
        "commit": state.commit_number,
        "values": state_lib.values_of(state),
        "ranks": strategy.extended.comm.Get_size(),
    }
    tf.io.gfile.makedirs(directory)
    _checkpoint(state, tf.Variable(json.dumps(record))).write(os.path.join(directory, _PREFIX))


def remove_saved(strategy: MPIStrategy, directory: str) -> None:
    """Removes a saved state once the launch that resumed from it has finished
    (once per filesystem when the strategy spans several ranks)."""
    ordered = write_point.ordered_comm_of(strategy)
    if ordered is None:
        tf.io.gfile.rmtree(directory)
        return
    with write_point.write_point(
        ordered, directory, "mpi_strategy.elastic: remove the saved state"
    ):
        if write_point.role() != write_point.IN_MEMORY:
            tf.io.gfile.rmtree(directory)


def _checkpoint(state: State, values: tf.Variable) -> tf.train.Checkpoint:
    trackables = {f"trackable_{i}": t for i, t in enumerate(state_lib.trackables_of(state))}
    return tf.train.Checkpoint(values=values, **trackables)


def describe(values: dict[str, Any]) -> str:
    """``values`` in one line, for messages."""
    return ", ".join(f"{k}={v!r}" for k, v in values.items()) or "no values"
