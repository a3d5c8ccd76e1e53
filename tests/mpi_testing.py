"""Helpers shared by the tests: the world under test, and where things are.

The world: ``WORLD`` (all ranks of this launch, 1 in a plain pytest run) with
``LOCAL_DEVICES`` logical CPU devices per rank (tests/conftest.py creates
them), and helpers for tests that are correct at any world size. The places:
the repository, and the child programs that the launcher tests run
(tests/programs/).
"""

import json
import os
import re

import numpy as np
import tensorflow as tf
from mpi4py import MPI

import mpi_strategy
from mpi_strategy._src.core import collective_ops, protocol
from mpi_strategy._src.distribute.ordered_comm import OrderedComm

LOCAL_DEVICES = int(os.environ.get("MPI_STRATEGY_TEST_LOCAL_DEVICES", "1"))
WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
SIZE = WORLD.Get_size()
NUM_REPLICAS = SIZE * LOCAL_DEVICES

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
PROGRAMS = os.path.join(TESTS, "programs")


def program(name):
    """The path of the child program ``name`` (tests/programs/NAME)."""
    return os.path.join(PROGRAMS, name)


def reports(output):
    """The ``REPORT {json}`` lines child programs print, as dicts (rank tags and
    other ranks' output may split or join lines)."""
    plain = re.sub(r"\[\d+\] ?", "", output)
    return [json.loads(m) for m in re.findall(r"REPORT (\{[^{}]*\})", plain)]


def saved_weights(path):
    """The arrays of an ``np.savez(path, *model.get_weights())``, in order."""
    with np.load(path) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


# The native kernels' op types, in the order of OrderedComm's methods (named
# like the numpy engine's ops: MPIAllreduce, ...).
NATIVE_OP_TYPES = tuple(c.native.type for c in collective_ops.ALL if c.native is not None)
# The op types of an MPI collective in a graph: the numpy engine's
# tf.numpy_function, or a native kernel.
MPI_OP_TYPES = frozenset({"PyFunc", *NATIVE_OP_TYPES})


def mpi_calls(graph):
    """The MPI collectives of ``graph``: [(name such as "MPIAllreduce", op)]."""
    return [
        (op.name.split("/")[-1].rstrip("_0123456789"), op)
        for op in graph.get_operations()
        if op.type in MPI_OP_TYPES
    ]


def on_python_engine(ordered):
    """``ordered`` (an OrderedComm), made to run its collectives on the numpy
    engine even where the native kernels are in use."""
    ordered._engines = [e for e in ordered._engines if e.name == "python"]
    return ordered


def ordered_comm(hashed=False):
    """A new OrderedComm over ``WORLD`` (collective), agreeing by comparing a
    hash when ``hashed`` (as above ``protocol.HASHED_ABOVE`` ranks)."""
    hashed_above = protocol.HASHED_ABOVE
    protocol.HASHED_ABOVE = -1 if hashed else hashed_above
    try:
        ordered = OrderedComm(WORLD)
    finally:
        protocol.HASHED_ABOVE = hashed_above
    assert ordered.agreement.hashed == hashed
    return ordered


def local_devices():
    return [f"/device:CPU:{i}" for i in range(LOCAL_DEVICES)]


def mpi_strategy_under_test(comm=None):
    return mpi_strategy.MPIStrategy(comm=comm, devices=local_devices())


def reference_strategy():
    """MirroredStrategy over as many replicas as MPIStrategy has across ranks."""
    return tf.distribute.MirroredStrategy(
        [f"/device:CPU:{i}" for i in range(NUM_REPLICAS)],
        cross_device_ops=tf.distribute.ReductionToOneDevice(),
    )


def gather_from_all_ranks(array):
    """Every rank's ``array`` (same shape on all ranks), stacked in rank order."""
    array = np.ascontiguousarray(array)
    out = np.empty((SIZE, *array.shape), array.dtype)
    WORLD.Allgather(array, out)
    return out


def assert_same_on_all_ranks(array, what="value"):
    array = np.asarray(array)
    everyone = gather_from_all_ranks(array)
    for r in range(SIZE):
        np.testing.assert_array_equal(
            everyone[r], everyone[0], err_msg=f"{what} on rank {r} differs from rank 0"
        )


def all_ranks_agree(ok):
    """True on every rank iff ``ok`` on every rank (so all ranks fail together)."""
    return bool(WORLD.allreduce(bool(ok), op=MPI.LAND))


def computed_on_rank0(fn):
    """``fn()`` evaluated once, on rank 0, and handed to every rank.

    For reference results that every rank would otherwise compute alike: the
    other ranks sleep meanwhile instead of competing for the cores (a plain
    MPI wait would spin).
    """
    import time

    result = fn() if RANK == 0 else None
    request = WORLD.Ibarrier()
    while not request.Test():
        time.sleep(0.005)
    return WORLD.bcast(result, root=0)
