"""The opt-in timeline (core/timeline.py, public as mpi_strategy.timeline): every
collective, per rank, split into waiting for the other ranks and transferring;
off, nothing changes."""

import os
import socket
import time

import numpy as np
import pytest
import tensorflow as tf

from mpi_strategy import timeline
from mpi_strategy._src.core import timeline as timeline_lib
from mpi_strategy._src.core.collectives import ArrayCollectives
from mpi_strategy._src.distribute.ordered_comm import OrderedComm
from mpi_testing import RANK, SIZE, WORLD, mpi_calls, on_python_engine

pytestmark = pytest.mark.device_agnostic  # the timeline files, no strategy's devices


def _collectives(mpi):
    return [
        mpi.allreduce_sum(tf.ones([1000])),
        mpi.allgather(tf.ones([RANK + 1, 2])),
        mpi.broadcast(tf.ones([3])),
    ]


def _on_engine(ordered, engine):
    """``ordered`` on ``engine`` ("native": the kernels, which take the
    timestamps in C; "python": the numpy engine)."""
    if engine == "python":
        return on_python_engine(ordered)
    if "native" not in ordered.engines and SIZE > 1:
        pytest.skip("the native kernels are not in use (MPI_STRATEGY_KERNELS)")
    return ordered


@pytest.mark.parametrize("engine", ["native", "python"])
def test_every_collective_is_one_event_with_its_wait_and_transfer(monkeypatch, shared_dir, engine):
    path = os.path.join(shared_dir, "trace.json")
    monkeypatch.setenv(timeline.ENV_VAR, path)
    step = tf.function(lambda: _collectives(mpi))
    mpi = _on_engine(OrderedComm(WORLD), engine)
    for _ in range(3):
        step()
    types = {op.type for _, op in mpi_calls(step.get_concrete_function().graph)}
    assert ("PyFunc" in types) == (engine == "python" and SIZE > 1), types
    if RANK == 0:
        time.sleep(0.3)  # the others wait for rank 0 in the next collective
    mpi.allreduce_sum(tf.ones([1000]))
    timeline_lib.current().close()
    WORLD.Barrier()  # every rank's file is complete (no collective after a failure)
    events = timeline.read_events(timeline.rank_path(path, RANK))
    spans = [e for e in events if e["ph"] == "X"]
    if SIZE == 1:  # a 1-rank world calls no MPI
        assert spans == []
        return
    late_wait, late_transfer = spans[-2:]
    if RANK != 0:  # waiting for rank 0 counts as waiting, not as transferring
        assert late_wait["dur"] > 0.2e6 and late_transfer["dur"] < 0.1e6, spans[-3:]
    spans = spans[:-3]
    kinds = [e["name"] for e in spans if e["name"] not in ("wait for ranks", "transfer")]
    assert kinds == ["allreduce", "all_gather", "broadcast"] * 3
    parents = [e for e in spans if e["name"] in kinds]
    assert [e["args"]["bytes"] for e in parents[:3]] == [4000, (RANK + 1) * 2 * 4, 12]
    assert [e["args"]["collective"] for e in parents] == list(range(1, 10))
    for i, parent in enumerate(parents):
        wait, transfer = spans[3 * i + 1], spans[3 * i + 2]
        assert (wait["name"], transfer["name"]) == ("wait for ranks", "transfer")
        assert wait["ts"] == parent["ts"] and wait["dur"] >= 0 and transfer["dur"] >= 0
        end = transfer["ts"] + transfer["dur"]
        assert end == pytest.approx(parent["ts"] + parent["dur"], abs=1.0)  # microseconds
    if RANK == 0:  # one file, one row per rank
        merged = timeline.read_events(timeline.merge(path))
        assert {e["pid"] for e in merged if e["ph"] == "X"} == set(range(SIZE))


@pytest.mark.parametrize("engine", ["native", "python"])
def test_off_by_default_the_collectives_are_not_wrapped(monkeypatch, engine):
    monkeypatch.delenv(timeline.ENV_VAR, raising=False)

    def timed(*args):
        raise AssertionError("a collective was wrapped for the timeline while it is off")

    monkeypatch.setattr(ArrayCollectives, "timed", timed)
    monkeypatch.setattr(ArrayCollectives, "record", timed)
    mpi = _on_engine(OrderedComm(WORLD), engine)
    step = tf.function(lambda: _collectives(mpi))
    out = step()
    np.testing.assert_array_equal(out[0].numpy(), np.full([1000], SIZE))
    for _, op in mpi_calls(step.get_concrete_function().graph):  # (kernels: not timed)
        assert op.type == "PyFunc" or op.get_attr("trace") == 0


def test_a_file_cut_short_by_a_crash_still_reads(tmp_path):
    path = str(tmp_path / "cut.json")
    with open(path, "w") as f:
        f.write(
            '[\n{"name": "a", "ph": "X", "ts": 1, "dur": 2, "pid": 0, "tid": 0},\n'
            '{"name": "b", "ph": "X", "ts": 3, "dur": 1, "pid": 0, "tid": 0}'
        )
    assert [e["name"] for e in timeline.read_events(path)] == ["a", "b"]


def test_files_are_named_by_the_rank_in_comm_world(monkeypatch, shared_dir):
    """Two strategies on disjoint COMM_WORLD.Split communicators never share a
    file: here rank r is rank SIZE-1-r of the communicator, and still writes
    trace.rank<r>.json."""
    if SIZE == 1:
        pytest.skip("a 1-rank world calls no MPI (no timeline events)")
    reversed_ranks = WORLD.Split(0, SIZE - 1 - RANK)
    assert reversed_ranks.Get_rank() == SIZE - 1 - RANK
    path = os.path.join(shared_dir, "split.json")
    monkeypatch.setenv(timeline.ENV_VAR, path)
    mpi = OrderedComm(reversed_ranks)
    mpi.allreduce_sum(tf.ones([3]))
    timeline_lib.current().close()
    WORLD.Barrier()
    events = timeline.read_events(timeline.rank_path(path, RANK))
    assert [e["args"]["name"] for e in events if e["name"] == "process_name"] == [
        f"rank {RANK} ({socket.gethostname()})"
    ]
    assert sorted(os.listdir(shared_dir)) == sorted(
        os.path.basename(timeline.rank_path(path, r)) for r in range(SIZE)
    )
