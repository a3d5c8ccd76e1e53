"""MPIClusterResolver: the MPI world described as TensorFlow's cluster resolver."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf
from mpi4py import MPI

if TYPE_CHECKING:
    from mpi_strategy._src.distribute.ordered_comm import OrderedComm

_HOST_BYTES = 256
# What TensorFlow's resolvers count in num_accelerators() (not CPUs).
_ACCELERATOR_TYPES = ("GPU", "TPU")


class MPIClusterResolver(tf.distribute.cluster_resolver.ClusterResolver):
    """Every rank of ``comm`` is a task of job ``"worker"``; ``task_id`` is the rank.

    Code written for MultiWorkerMirroredStrategy that asks
    ``strategy.cluster_resolver.task_id == 0`` ("am I the chief?") keeps working.
    ``cluster_spec()`` lists each rank's host name (there are no ports: MPI,
    not gRPC, connects the ranks). ``num_accelerators()`` counts the GPUs (or
    TPUs) each rank drives, as TensorFlow's resolvers do: ``{"GPU": n}``, and
    ``{}`` for ranks that compute on the CPU.
    """

    def __init__(
        self,
        comm: MPI.Intracomm,
        num_local_devices: dict[str, int] | None = None,
        ordered_comm: Callable[[], OrderedComm] | None = None,
    ) -> None:
        """``num_local_devices``: this rank's devices by type, e.g. ``{"GPU": 2}``
        (CPUs may be listed; they are not accelerators). ``ordered_comm``: the
        strategy's collectives (what TensorFlow's preemption handler agrees
        through, ``features/preemption``)."""
        self._comm = comm
        self._ordered_comm = ordered_comm
        self._num_accelerators = {
            kind: int(n)
            for kind, n in (num_local_devices or {}).items()
            if kind.upper() in _ACCELERATOR_TYPES and n
        }
        self._hosts = _gather_host_names(comm)

    @property
    def task_type(self) -> str:
        return "worker"

    @property
    def task_id(self) -> int:
        return self._comm.Get_rank()

    @property
    def num_workers(self) -> int:
        return self._comm.Get_size()

    @property
    def environment(self) -> str:
        return "mpi"

    def cluster_spec(self) -> tf.train.ClusterSpec:
        return tf.train.ClusterSpec({"worker": list(self._hosts)})

    def master(self, task_type: Any = None, task_id: Any = None, rpc_layer: Any = None) -> str:
        del task_type, task_id, rpc_layer
        return ""  # no TF server: there is nothing to connect to

    def ordered_comm(self) -> OrderedComm:
        """The ordered communicator of the strategy this resolver describes."""
        if self._ordered_comm is None:
            raise ValueError("mpi_strategy: this resolver belongs to no MPIStrategy.")
        return self._ordered_comm()

    def noticed(self) -> tuple[int, int] | None:
        """``(signal, collective number)``: the first preemption notice any rank
        posted, learnt from a collective of the strategy; the same on every
        rank once that collective is done (None: no notice yet)."""
        return self.ordered_comm().agreement.noticed

    def num_accelerators(
        self, task_type: Any = None, task_id: Any = None, config_proto: Any = None
    ) -> dict[str, int]:
        # Every rank drives the same number of devices (MPIStrategy checks),
        # so this rank's count holds for every task.
        del task_type, task_id, config_proto
        return dict(self._num_accelerators)


def _gather_host_names(comm: MPI.Intracomm) -> list[str]:
    # Fixed-size byte buffers rather than pickles: nothing received is unpickled.
    mine = np.zeros(_HOST_BYTES, np.uint8)
    name = (MPI.Get_processor_name() or socket.gethostname()).encode()[:_HOST_BYTES]
    mine[: len(name)] = np.frombuffer(name, np.uint8)
    everyone = np.empty((comm.Get_size(), _HOST_BYTES), np.uint8)
    comm.Allgather(mine, everyone)
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in everyone]
