"""MPIStrategy: TensorFlow's replica semantics across MPI ranks.

Each rank runs the same program and drives ``len(devices)`` local replicas, as
``tf.distribute.MirroredStrategy`` does in one process; ``MPIExtended`` makes
the replica set global (``comm.size * len(devices)`` replicas with global ids),
shards input by rank, starts every variable from rank 0's initial value, and
routes every cross-replica reduction, gather and broadcast, including those
MirroredStrategy keeps local (int32 values, reductions to the host, metrics),
through ``MPICrossDeviceOps``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf
from mpi4py import MPI

from mpi_strategy._src import _tf_internal
from mpi_strategy._src.core import failure, logs
from mpi_strategy._src.core.errors import MPIStrategyError
from mpi_strategy._src.core.logs import logger
from mpi_strategy._src.core.process import PROCESS
from mpi_strategy._src.core.validation import (
    check_same_on_all_ranks,
    mpi_library,
    resolve_comm,
    spans_the_world,
)
from mpi_strategy._src.distribute import compression as compression_lib, datasets, sharding
from mpi_strategy._src.distribute.cluster_resolver import MPIClusterResolver
from mpi_strategy._src.distribute.cross_device_ops import MPICrossDeviceOps
from mpi_strategy._src.distribute.ordered_comm import OrderedComm

ReduceOp = tf.distribute.ReduceOp


@dataclass
class StrategyState:
    """The binding's part of the process state (``PROCESS.of``)."""

    # Run whenever an MPIStrategy is built or its scope entered: effects.py adds
    # its installer here (Keras imported meanwhile gets adapted), as the layer
    # below it cannot import it.
    scope_listeners: list[Callable[[], None]] = field(default_factory=list)
    # The newest MPIStrategy over all of COMM_WORLD (or all its living ranks):
    # where writes that name no object meet, and where the program's end is
    # agreed on. Held strongly: whether a rank meets the others must never depend
    # on what its program still holds.
    world: MPIStrategy | None = None
    warned_ignored: bool = False
    # The same random text on every rank of this job (job_id()).
    job: str | None = None


def _state() -> StrategyState:
    return PROCESS.of(StrategyState)


def on_scope(listener: Callable[[], None]) -> None:
    """Calls ``listener()`` whenever an MPIStrategy is built or its scope
    entered, or another face starts its MPI work (``face_started``)."""
    if listener not in _state().scope_listeners:
        _state().scope_listeners.append(listener)


def newest_over_the_world() -> MPIStrategy | None:
    """The newest MPIStrategy over all of ``COMM_WORLD`` with several ranks (or
    all its living ranks after ranks were lost), or None."""
    return _state().world


def job_id() -> str | None:
    """The same random text on every rank of this job (and another in the next
    job), drawn when the first MPIStrategy over the world was built; None
    before. Saves that need no MPI call tell this job's files by it."""
    return _state().job


def _draw_job_id(comm: MPI.Intracomm) -> str:
    """Rank 0's job id (drawn at random if it has none) on every rank of
    ``comm``: a replacement of a lost rank takes the survivors'."""
    job = _state().job
    drawn = np.frombuffer(bytes.fromhex(job) if job else os.urandom(16), np.uint8).copy()
    comm.Bcast(drawn, root=0)
    return drawn.tobytes().hex()


class MPIStrategy(tf.distribute.Strategy):
    """Synchronous data-parallel training over MPI, with TensorFlow's own API.

    Launch the same program on every rank (``mpiexec -n N python train.py``);
    run without ``mpiexec`` it is a one-rank world. ``num_replicas_in_sync`` is
    ``comm.size * len(devices)`` and every rank sees the result of every
    cross-replica reduction, exactly as the N replicas of a
    ``tf.distribute.MirroredStrategy`` in one process would.

    Collectives are matched by order: every rank must run the same sequence of
    reductions (same steps, same variables created in the same order).

    Args:
      comm: mpi4py intracommunicator over the ranks that train together
        (default ``MPI.COMM_WORLD``).
      devices: this rank's local devices (default: its share of the node's
        GPUs, else the CPU). Every rank must have the same number.
      communication_options: ``tf.distribute.experimental.CommunicationOptions``,
        merged into the options of every collective. ``timeout_seconds=T``
        makes a rank that waits more than T seconds for the others to reach a
        collective raise an error naming the collective and the missing ranks
        (without it, such a rank waits forever, as MPI does).
        ``bytes_per_pack=B`` sums the gradients in buckets of about B bytes,
        last layers first, so that their MPI calls overlap the rest of the
        backward pass (worth it where the network is slow; the same sums,
        to the last bit at 2 ranks and with MPICH: see ``fusion.py``).
        ``implementation`` is accepted and ignored (with a
        warning, once).
      compression: None (default: exact sums), ``"float16"`` or
        ``"bfloat16"``: float tensors of 16 KiB or more in an all-reduce (the
        weight gradients) travel in 16 bits, half the bytes of float32, for
        networks where bandwidth limits the step. Lossy. Or a policy object,
        e.g. ``mpi_strategy.compression.SixteenBit("bfloat16", min_bytes=...)``
        for another threshold: see ``mpi_strategy.compression``.
      shard: None (default: every rank holds the optimizer's whole state) or
        ``"optimizer"``: each rank keeps the optimizer's per-variable state
        (Adam's moments, momentum, ...) for its share of the variables only,
        about 1/N of it, updates those variables and all-gathers them (ZeRO
        stage 1; Keras 3 and tf_keras optimizers; the same numbers as without it; see
        docs/sharding.md). ``"gradients"``: that, and the gradients are
        summed by a reduce-scatter, each rank receiving the sum of its share
        only (ZeRO stage 2; Keras 3 optimizers; exact sums, no ``compression``; the same numbers
        at 2 ranks, beyond which MPI may add in another order). Every rank
        must pass the same.
    """

    # MirroredExtended reads this from its container strategy.
    _collective_key_base = 0

    extended: MPIExtended

    def __init__(
        self,
        comm: MPI.Intracomm | None = None,
        devices: Sequence[str] | None = None,
        communication_options: tf.distribute.experimental.CommunicationOptions | None = None,
        compression: str | compression_lib.CompressionPolicy | None = None,
        shard: str | None = None,
    ) -> None:
        extended = MPIExtended(
            self,
            comm=comm,
            devices=devices,
            communication_options=communication_options,
            compression=compression,
            shard=shard,
        )
        super().__init__(extended)
        extended.announce()

    def scope(self) -> contextlib.AbstractContextManager[Any]:
        """As ``tf.distribute.Strategy.scope``; also adapts Keras imported since
        construction (predict rows from all ranks, rank-0-only output, saving)."""
        _notify_scope_listeners()
        return super().scope()

    def __repr__(self) -> str:
        ext = self.extended
        return (
            f"MPIStrategy(rank={ext.rank}, size={ext.comm.Get_size()}, "
            f"devices={list(ext.worker_devices)}"
            + (f", shard={ext.shard!r})" if ext.shard else ")")
        )


class MPIExtended(_tf_internal.MirroredExtended):
    """The MirroredStrategy machinery, made global across the ranks of ``comm``."""

    _cross_device_ops: MPICrossDeviceOps

    def __init__(
        self,
        container_strategy: MPIStrategy,
        comm: MPI.Intracomm | None = None,
        devices: Sequence[str] | None = None,
        communication_options: tf.distribute.experimental.CommunicationOptions | None = None,
        compression: str | compression_lib.CompressionPolicy | None = None,
        shard: str | None = None,
    ) -> None:
        # Checked before any MPI call or process-wide hook, alike on every rank.
        compression = compression_lib.resolve(compression)
        self._shard = sharding.resolve(shard)
        if self._shard == "gradients" and type(compression) is not compression_lib.Exact:
            raise MPIStrategyError(
                "mpi_strategy: MPIStrategy(shard='gradients') sums the gradients exactly, in a "
                f"reduce-scatter; compression={compression.name!r} is not combined with it. Use "
                "shard='optimizer' (its all-reduce compresses) or no compression."
            )
        comm = resolve_comm(comm)
        if communication_options is None:
            communication_options = tf.distribute.experimental.CommunicationOptions()
        # CommunicationOptions is a factory; the instances' class is private.
        if not isinstance(
            communication_options, type(tf.distribute.experimental.CommunicationOptions())
        ):
            raise TypeError(
                "mpi_strategy: communication_options must be a "
                "tf.distribute.experimental.CommunicationOptions, got "
                f"{type(communication_options).__name__}."
            )
        _warn_once_if_ignored(communication_options)
        self._comm = comm
        self._rank = comm.Get_rank()
        self._num_ranks = comm.Get_size()
        # From the first collective on, an uncaught error ends the job: under
        # ULFM a rank lost now fails the next call on the others, whose ordinary
        # exit could then wait in MPI_Finalize for the dead rank (ompi#11404).
        failure.arm(comm)
        _notify_scope_listeners()
        devices = list(devices) if devices else default_devices(comm)
        check_same_on_all_ranks(comm, len(devices), "number of devices per rank")
        check_same_on_all_ranks(comm, sharding.MODES.index(self._shard), "shard= argument")
        super().__init__(
            container_strategy,
            devices=devices,
            cross_device_ops=MPICrossDeviceOps(comm, communication_options, compression),
        )
        # MirroredExtended defaults these to NCCL / single-process values.
        self._communication_options = communication_options
        self.experimental_enable_get_next_as_optional = True
        self._cluster_resolver = MPIClusterResolver(
            comm,
            {_device_type(self._devices[0]): len(self._devices)},
            ordered_comm=lambda: self.ordered_comm,
        )
        # Read by tf_keras (as from MultiWorkerMirroredStrategy) to name the
        # scratch directories where non-chief ranks write checkpoints.
        self._task_type, self._task_id = "worker", self._rank
        logger.info(
            "MPIStrategy: %d rank(s) x %d device(s) = %d replicas (%s); %s; collective "
            "timeout: %s; compression: %s; sharded: %s",
            self._num_ranks,
            len(self._devices),
            self._num_replicas_in_sync,
            ", ".join(self._devices),
            mpi_library(),
            f"{communication_options.timeout_seconds} s"
            if communication_options.timeout_seconds
            else "none",
            self._cross_device_ops.compression,
            self._shard or "nothing",
        )

    def announce(self) -> None:
        """Once built: it is where writes that name no object meet if it spans
        the world, and process-wide effects adapt Keras imported so far."""
        if self._num_ranks > 1 and spans_the_world(self._comm):
            _state().world = self._container_strategy()
            if _state().job is None:  # (the same on every rank of the world)
                _state().job = _draw_job_id(self._comm)
        _notify_scope_listeners()

    @property
    def ordered_comm(self) -> OrderedComm:
        """The ordered communicator every collective of this strategy runs on."""
        return self._cross_device_ops.ordered_comm

    def continue_on(self, comm: MPI.Intracomm) -> None:
        """Makes this strategy span ``comm`` (the survivors after ranks died, or
        survivors and replacements, see ``features/elastic``) instead of its
        communicator: its variables, devices and options stay; its rank, world
        size, replica ids and collectives change. Collective over ``comm``.
        Functions traced before must be traced again."""
        failure.arm(comm)  # (a replacement started alone in its own world)
        check_same_on_all_ranks(comm, len(self._devices), "number of devices per rank")
        self._comm = comm
        self._rank = comm.Get_rank()
        self._num_ranks = comm.Get_size()
        self._cross_device_ops = MPICrossDeviceOps(
            comm, self._communication_options, self._cross_device_ops.policy
        )
        _state().world = self._container_strategy()  # all the living ranks
        _state().job = _draw_job_id(comm)
        self._cluster_resolver = MPIClusterResolver(
            comm,
            {_device_type(self._devices[0]): len(self._devices)},
            ordered_comm=lambda: self.ordered_comm,
        )
        self._task_id = self._rank
        logs.set_rank(self._rank, self._num_ranks)  # rank 0 of the survivors speaks

    def _initialize_strategy(self, devices: Sequence[str]) -> None:
        # MirroredExtended would also build TF collective ops for the local
        # devices; every collective here is MPI, so only the devices are set up.
        devices = tuple(tf.DeviceSpec.from_string(d).to_string() for d in devices)
        if len(set(devices)) != len(devices):
            raise ValueError(f"mpi_strategy: duplicate devices in {devices}.")
        self._initialize_single_worker(devices)

    # -- identity of this rank ---------------------------------------------------
    @property
    def comm(self) -> MPI.Intracomm:
        """The mpi4py communicator of this strategy."""
        return self._comm

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def shard(self) -> str | None:
        """What each rank keeps only its share of: None, "optimizer" (the
        optimizer's state) or "gradients" (that and the summed gradients)."""
        return self._shard

    @property
    def timeout_seconds(self) -> float | None:
        """``communication_options.timeout_seconds``: how long a rank waits in
        a collective for the others before raising (None: forever)."""
        return self._communication_options.timeout_seconds or None

    @property
    def _num_replicas_in_sync(self) -> int:
        return len(self._devices) * self._num_ranks

    def _get_replica_id_in_sync_group(self, replica_id: int) -> int:
        return self._rank * len(self._devices) + replica_id

    def _get_local_replica_id(self, replica_id_in_sync_group: int) -> int:
        return replica_id_in_sync_group - self._rank * len(self._devices)

    def _in_multi_worker_mode(self) -> bool:
        # Makes the distributed iterator agree across ranks on the end of data.
        return self._num_ranks > 1

    @property
    def experimental_between_graph(self) -> bool:
        return True

    @property
    def should_checkpoint(self) -> bool:
        return self._rank == 0

    @property
    def should_save_summary(self) -> bool:
        return self._rank == 0

    # -- communication: always MPI ---------------------------------------------
    def _use_merge_call(self) -> bool:
        # TF and Keras ask this before they synchronize replicas. merge_call
        # (MirroredStrategy's path, where the MPI collectives run in cross-replica
        # context) works only in the graph the replica function is traced in;
        # inside a tf.cond, tf.while_loop or nested tf.function of that
        # function it fails, and that is where Keras' optimizers synchronize
        # with gradient_accumulation_steps or ema_overwrite_frequency. There,
        # with one device per rank, the rank's only replica issues the MPI
        # collectives itself (_replica_ctx_all_reduce below; variable updates
        # go to its own copy). Several local devices must meet in merge_call.
        # (XLA is no reason either way: the MPI ops reject it on both paths.)
        if not _tf_internal.merge_call_would_fail():
            return True
        if len(self._devices) == 1:
            return False
        raise MPIStrategyError(
            "mpi_strategy: replicas synchronize inside tf.cond, tf.while_loop or a "
            "nested tf.function (as Keras optimizers do with gradient_accumulation_steps "
            "or ema_overwrite_frequency); MPIStrategy supports this with one device "
            f"per rank only, and this rank drives {len(self._devices)} devices. Launch "
            "one rank per device instead (MPIStrategy(devices=[one device]) on each rank)."
        )

    def _replica_ctx_all_reduce(self, reduce_op: Any, value: Any, options: Any = None) -> Any:
        # ReplicaContext.all_reduce and aggregated variable updates call this
        # when _use_merge_call() is False: one replica per rank, so its value
        # is the rank's contribution and one MPI reduction gives the result.
        if self._use_merge_call():
            return super()._replica_ctx_all_reduce(reduce_op, value, options)
        options = self._communication_options.merge(options)
        reduced = self._cross_device_ops.all_reduce_values(
            reduce_op,
            tf.nest.flatten(value),
            timeout=options.timeout_seconds,
            bytes_per_pack=options.bytes_per_pack,
        )
        return tf.nest.pack_sequence_as(
            value, [_tf_internal.simple_broadcast(r, self._devices[0]) for r in reduced]
        )

    def _get_cross_device_ops(self, value: Any) -> MPICrossDeviceOps:
        del value
        return self._cross_device_ops

    def _reduce_to(self, reduce_op: Any, value: Any, destinations: Any, options: Any) -> Any:
        # `value` may be a nested structure (Keras reduces whole batches):
        # all of its leaves go into one batch reduction.
        leaves = tf.nest.flatten(value)
        to_reduce = [
            i
            for i, leaf in enumerate(leaves)
            if not (reduce_op == ReduceOp.MEAN and _tf_internal.is_mirrored(leaf))
        ]
        if to_reduce:  # (a mirrored MEAN is already the same on every replica)
            reduced = self._cross_device_ops.batch_reduce(
                reduce_op,
                [(leaves[i], destinations) for i in to_reduce],
                options=self._communication_options.merge(options),
            )
            for i, r in zip(to_reduce, reduced):
                leaves[i] = r
        return tf.nest.pack_sequence_as(value, leaves)

    def _batch_reduce_to(
        self, reduce_op: Any, value_destination_pairs: Any, options: Any
    ) -> list[Any]:
        return self._cross_device_ops.batch_reduce(
            reduce_op, value_destination_pairs, options=self._communication_options.merge(options)
        )

    def _gather_to_implementation(
        self, value: Any, destinations: Any, axis: int, options: Any
    ) -> Any:
        return self._cross_device_ops._gather(
            value,
            destinations=destinations,
            axis=axis,
            options=self._communication_options.merge(options),
        )

    # -- variables start equal on every rank -------------------------------------
    def _get_variable_creator_initial_value(
        self, replica_id: int, device: Any, primary_var: Any, **kwargs: Any
    ) -> Any:
        if replica_id != 0 or self._num_ranks == 1 or sharding.starting_alike():
            # Other local replicas copy the first one, as in MirroredStrategy;
            # a sharded slot starts alike on its owner alone.
            return super()._get_variable_creator_initial_value(
                replica_id, device, primary_var, **kwargs
            )
        initial_value = kwargs["initial_value"]
        dtype = kwargs.get("dtype")

        def initial_value_of_rank_0() -> tf.Tensor:
            with tf.device(device):
                value = initial_value() if callable(initial_value) else initial_value
                # Restore-on-create wraps the value; the broadcast needs the tensor.
                value = getattr(value, "wrapped_value", value)
                value = tf.convert_to_tensor(value, dtype=dtype)
                return tf.identity(self._cross_device_ops.broadcast_from_root(value))

        return initial_value_of_rank_0

    # -- input: each rank reads its own shard -------------------------------------
    def input_context(self) -> tf.distribute.InputContext:
        """This rank's input pipeline: one per rank, numbered by rank."""
        return tf.distribute.InputContext(
            num_input_pipelines=self._num_ranks,
            input_pipeline_id=self._rank,
            num_replicas_in_sync=self._num_replicas_in_sync,
        )

    def _experimental_distribute_dataset(self, dataset: Any, options: Any) -> Any:
        return datasets.distribute_dataset(
            dataset,
            self._input_workers_with_options(options),
            self._container_strategy(),
            num_replicas_in_sync=self._num_replicas_in_sync,
            input_context=self.input_context(),
            options=options,
        )

    def _distribute_datasets_from_function(
        self, dataset_fn: Callable[..., Any], options: Any
    ) -> Any:
        return datasets.distribute_datasets_from_function(
            dataset_fn,
            self._input_workers_with_options(options),
            self._container_strategy(),
            input_context=self.input_context(),
            options=options,
        )

    def _experimental_distribute_values_from_function(self, value_fn: Callable[..., Any]) -> Any:
        values = [
            value_fn(
                tf.distribute.experimental.ValueContext(
                    self._get_replica_id_in_sync_group(i), self._num_replicas_in_sync
                )
            )
            for i in range(len(self._devices))
        ]
        return _tf_internal.regroup(values, always_wrap=True)


def face_started() -> None:
    """Another public face (Horovod's ``init``) has started its MPI work: the
    listeners learn of it as of an MPIStrategy's construction."""
    _notify_scope_listeners()


def _notify_scope_listeners() -> None:
    for listener in _state().scope_listeners:
        listener()


def default_devices(comm: MPI.Intracomm) -> list[str]:
    """This rank's devices: its share of the node's GPUs, else the CPU.

    With one rank per node that is every GPU (as MirroredStrategy); with
    several ranks on a node the GPUs are split evenly between them.
    """
    gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
    if not gpus:
        return ["/device:CPU:0"]
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        local_rank, local_size = node.Get_rank(), node.Get_size()
    finally:
        node.Free()
    if local_size == 1:
        return gpus
    per_rank = max(1, len(gpus) // local_size)
    start = (local_rank * per_rank) % len(gpus)
    return gpus[start : start + per_rank]


def _warn_once_if_ignored(options: tf.distribute.experimental.CommunicationOptions) -> None:
    """Says (once per process) which options that MPIStrategy ignores were set."""
    ignored = []
    if options.implementation != tf.distribute.experimental.CommunicationImplementation.AUTO:
        ignored.append(f"implementation={options.implementation.name}")
    if ignored and not _state().warned_ignored:
        _state().warned_ignored = True
        logger.warning(
            "MPIStrategy ignores CommunicationOptions(%s): every reduction goes "
            "through MPI, one fused collective per dtype.",
            ", ".join(ignored),
        )


def _device_type(device: str) -> str:
    return tf.DeviceSpec.from_string(device).device_type or "CPU"
