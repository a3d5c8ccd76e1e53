"""What is reduced: the tf.distribute.CrossDeviceOps where TF values meet MPI.

Every cross-replica reduction, gather and broadcast of MPIStrategy goes through
``MPICrossDeviceOps``: values of this rank's local replicas are first combined
locally, then once across ranks through the ordered MPI ops, then copied to
the requested destination devices. Every rank gets the same result.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from mpi4py import MPI

from mpi_strategy._src import _tf_internal
from mpi_strategy._src.core.validation import check_same_on_all_ranks, resolve_comm
from mpi_strategy._src.distribute import compression as compression_lib, fusion
from mpi_strategy._src.distribute.ordered_comm import OrderedComm

ReduceOp = tf.distribute.ReduceOp


class MPICrossDeviceOps(tf.distribute.CrossDeviceOps):
    """Cross-replica communication over an mpi4py communicator.

    ``reduce`` / ``batch_reduce`` give every rank the SUM (or MEAN) over all
    replicas of all ranks; a ``batch_reduce`` of many dense tensors is one MPI
    Allreduce per dtype. ``tf.IndexedSlices`` are all-gathered, not densified
    (all of one ``batch_reduce`` in one MPI call).
    ``broadcast`` gives every rank the value of rank 0. A plain tensor (not a
    ``DistributedValues``) counts as one value per rank.

    Args:
      comm: an mpi4py intracommunicator (default ``MPI.COMM_WORLD``).
      options: default ``tf.distribute.experimental.CommunicationOptions``;
        ``timeout_seconds`` bounds how long a rank waits for the others to
        reach a collective (default: no limit). Options passed to a call are
        merged over these.
      compression: None (exact sums), ``"float16"`` or ``"bfloat16"``: large
        floating-point reductions (the gradients) travel in 16 bits, half the
        bytes; or a policy object such as
        ``compression.SixteenBit("bfloat16", min_bytes=...)`` (the protocol is
        in ``mpi_strategy.compression``; checked here). The same on every rank.
    """

    def __init__(
        self,
        comm: MPI.Intracomm | None = None,
        options: tf.distribute.experimental.CommunicationOptions | None = None,
        compression: str | compression_lib.CompressionPolicy | None = None,
    ) -> None:
        super().__init__()
        self._options = options or tf.distribute.experimental.CommunicationOptions()
        # Before any MPI call: a bad policy raises on every rank, none waits.
        self._compression = compression_lib.resolve(compression)
        comm = resolve_comm(comm)
        check_same_on_all_ranks(
            comm, zlib.crc32(self.compression.encode()), f"compression (here {self.compression!r})"
        )
        self._mpi = OrderedComm(comm, name_missing_ranks=self._options.timeout_seconds is not None)

    @property
    def policy(self) -> compression_lib.CompressionPolicy:
        """The compression policy object (see ``mpi_strategy.compression``)."""
        return self._compression

    @property
    def compression(self) -> str:
        """How large float sums travel: "none", "float16", "bfloat16" or a policy's name."""
        return self._compression.name

    def _timeout(self, options: Any) -> float | None:
        return self._options.merge(options).timeout_seconds

    @property
    def comm(self) -> MPI.Intracomm:
        """The mpi4py communicator the collectives run on."""
        return self._mpi.comm

    @property
    def ordered_comm(self) -> OrderedComm:
        """The ``OrderedComm`` that issues the collectives."""
        return self._mpi

    @property
    def _num_between_graph_workers(self) -> int:
        # TF skips reductions entirely when this is 1 and there is one replica.
        return self._mpi.size

    # -- reductions --------------------------------------------------------------
    def reduce_implementation(
        self, reduce_op: Any, per_replica_value: Any, destinations: Any, options: Any
    ) -> Any:
        return self.batch_reduce_implementation(
            reduce_op, [(per_replica_value, destinations)], options
        )[0]

    def batch_reduce_implementation(
        self, reduce_op: Any, value_destination_pairs: Sequence[tuple[Any, Any]], options: Any
    ) -> list[Any]:
        options = self._options.merge(options)
        reduced = self.all_reduce_values(
            reduce_op,
            [value for value, _ in value_destination_pairs],
            timeout=options.timeout_seconds,
            bytes_per_pack=options.bytes_per_pack,
        )
        return [
            _tf_internal.simple_broadcast(r, destinations)
            for r, (_, destinations) in zip(reduced, value_destination_pairs)
        ]

    def all_reduce_values(
        self,
        reduce_op: tf.distribute.ReduceOp | str,
        values: list[Any],
        timeout: float | None = None,
        bytes_per_pack: int | None = None,
    ) -> list[Any]:
        """Reduces each of ``values`` over all replicas of all ranks.

        Returns one tensor (or ``IndexedSlices``) per value, on the host, the
        same on every rank. Dense values are summed in one MPI call per dtype,
        or, with ``bytes_per_pack`` > 0 (default: this object's
        ``CommunicationOptions.bytes_per_pack``), in buckets of about that many
        bytes, last values first (``fusion.buckets``): bit-identical sums, and a
        bucket's MPI call can run while the values of later buckets are computed.
        """
        if bytes_per_pack is None:
            bytes_per_pack = self._options.bytes_per_pack
        allreduce = functools.partial(self._compression.allreduce, mpi=self._mpi, timeout=timeout)
        reduce_op = ReduceOp(reduce_op) if isinstance(reduce_op, str) else reduce_op
        parts = [_local_values(v) for v in values]
        dense = [i for i, p in enumerate(parts) if not _is_sparse(p[0])]
        sparse = [i for i, p in enumerate(parts) if _is_sparse(p[0])]

        results: list[Any] = [None] * len(values)
        local_sums = [_local_sum(parts[i]) for i in dense]
        # With sparse values, a few kB of dense ones (biases, a small dense
        # layer) ride along in the sparse values' all_gather: one collective.
        riding = bool(sparse) and self._can_ride_along(local_sums, bytes_per_pack)
        if not riding:
            for i, r in zip(dense, fusion.fused_allreduce(local_sums, allreduce, bytes_per_pack)):
                results[i] = r
        gathered = self._allgather_indexed_slices(
            [parts[i] for i in sparse], timeout, local_sums if riding else []
        )
        for i, r in zip(sparse + (dense if riding else []), gathered):
            results[i] = r

        if reduce_op == ReduceOp.MEAN:
            for i, p in enumerate(parts):
                results[i] = _divide(results[i], len(p) * self._mpi.size)
        elif reduce_op != ReduceOp.SUM:
            raise ValueError(f"reduce_op must be SUM or MEAN, got {reduce_op}")
        return results

    def _can_ride_along(self, dense: Sequence[tf.Tensor], bytes_per_pack: int | None) -> bool:
        """Whether ``dense`` (this rank's sums) may be summed through an all_gather:
        exact sums, no buckets, one summable dtype, static shapes, a few kB."""
        if not dense or self._mpi.size == 1 or bytes_per_pack:
            return False
        if type(self._compression) is not compression_lib.Exact:
            return False
        if len({t.dtype for t in dense}) != 1 or dense[0].dtype not in _SUMMABLE:
            return False
        if not all(t.shape.is_fully_defined() for t in dense):
            return False
        return sum(t.shape.num_elements() * t.dtype.size for t in dense) <= _RIDE_ALONG_BYTES

    def _allgather_indexed_slices(
        self,
        values: Sequence[Sequence[tf.IndexedSlices]],
        timeout: float | None,
        dense: Sequence[tf.Tensor] = (),
    ) -> list[Any]:
        """Sums of ``values`` (each a list of this rank's IndexedSlices), all in one
        MPI call, followed by the sums of ``dense`` (tensors of one dtype) if any.

        Summing IndexedSlices = concatenating them: the rows of repeated
        indices are added when the slices are applied. Every table's values
        and indices travel in one all_gather, however many tables there are:
        concatenated by TensorFlow into one values tensor, one indices tensor
        and the tables' row counts (each tensor that crosses into Python costs
        several microseconds), then cut back into tables, in rank order.
        """
        if not values:
            return []
        flat_dense = [tf.concat([tf.reshape(t, [-1]) for t in dense], axis=0)] if dense else []
        tables = [
            (
                tf.concat([s.values for s in slices], axis=0),
                tf.concat([tf.cast(s.indices, slices[0].indices.dtype) for s in slices], axis=0),
            )
            for slices in values
        ]
        if len({v.dtype for v, _ in tables}) != 1 or not all(
            v.shape[1:].is_fully_defined() for v, _ in tables
        ):
            gathered = self._allgather_tables(values, tables, flat_dense, timeout)
            return gathered[: len(values)] + self._summed(gathered[len(values) :], dense)
        widths = [v.shape[1:].num_elements() for v, _ in tables]
        counts, flat_values, flat_indices, *gathered_dense = self._mpi.allgather_many(
            [
                tf.stack([tf.shape(v, out_type=tf.int64)[0] for v, _ in tables]),
                tf.concat([tf.reshape(v, [-1]) for v, _ in tables], axis=0),
                tf.concat([tf.cast(i, tf.int64) for _, i in tables], axis=0),
                *flat_dense,
            ],
            timeout,
        )
        k, ranks = len(tables), self._mpi.size
        value_pieces = tf.split(
            flat_values, counts * tf.tile(tf.constant(widths, tf.int64), [ranks]), num=k * ranks
        )
        index_pieces = tf.split(flat_indices, counts, num=k * ranks)
        return [
            tf.IndexedSlices(
                values=tf.reshape(
                    tf.concat(value_pieces[t::k], axis=0), [-1, *v.shape[1:].as_list()]
                ),
                indices=tf.cast(tf.concat(index_pieces[t::k], axis=0), i.dtype),
                dense_shape=slices[0].dense_shape,
            )
            for t, ((v, i), slices) in enumerate(zip(tables, values))
        ] + self._summed(gathered_dense, dense)

    def _allgather_tables(
        self,
        values: Sequence[Sequence[tf.IndexedSlices]],
        tables: Sequence[tuple[tf.Tensor, tf.Tensor]],
        extra: Sequence[tf.Tensor],
        timeout: float | None,
    ) -> list[Any]:
        """``_allgather_indexed_slices`` with every table's tensors crossing on
        their own; then the gathered ``extra`` tensors."""
        gathered = self._mpi.allgather_many(
            [t for table in tables for t in table] + list(extra), timeout
        )
        return [
            tf.IndexedSlices(
                values=gathered[2 * k],
                indices=gathered[2 * k + 1],
                dense_shape=slices[0].dense_shape,
            )
            for k, slices in enumerate(values)
        ] + gathered[2 * len(values) :]

    def _summed(self, gathered: Sequence[tf.Tensor], dense: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """The sums of ``dense`` from their all_gather (every rank's values, one
        after another), added in rank order: the same bits on every rank."""
        if not dense:
            return []
        rows = tf.reshape(gathered[0], [self._mpi.size, -1])
        total = rows[0]
        for r in range(1, self._mpi.size):
            total = total + rows[r]
        parts = tf.split(total, [t.shape.num_elements() for t in dense])
        return [tf.reshape(part, t.shape) for part, t in zip(parts, dense)]

    # -- gather --------------------------------------------------------------
    def _gather_implementation(
        self, per_replica_value: Any, destinations: Any, axis: int, options: Any
    ) -> Any:
        gathered = self.all_gather_values(per_replica_value, axis, self._timeout(options))
        return _tf_internal.simple_broadcast(gathered, destinations)

    def all_gather_values(self, value: Any, axis: int, timeout: float | None = None) -> tf.Tensor:
        """Concatenation along ``axis`` of every replica's value, in replica order."""
        local = tf.concat(_local_values(value), axis=axis)
        rank = local.shape.rank
        if rank is None:
            raise ValueError("mpi_strategy: gather needs tensors of known rank.")
        axis = axis % rank if rank else 0
        if axis == 0:
            return self._mpi.allgather(local, timeout)
        perm = [axis] + [d for d in range(rank) if d != axis]
        inverse = [perm.index(d) for d in range(rank)]
        return tf.transpose(self._mpi.allgather(tf.transpose(local, perm), timeout), inverse)

    # -- broadcast -----------------------------------------------------------
    def broadcast_implementation(self, tensor: Any, destinations: Any) -> Any:
        # What TF broadcasts is rank 0's first replica's new value of a
        # variable whose aggregation is ONLY_FIRST_REPLICA: every step,
        # optimizer.iterations + 1. A value that every rank computes alike is
        # not sent; the constants it is made of are checked at the next
        # collective (OrderedComm.check_same_constants).
        constants = _constants_if_same_on_every_rank(tensor, destinations)
        if constants is not None:
            self._mpi.check_same_constants(constants)
            value = tf.convert_to_tensor(tensor)
        else:
            value = self._mpi.broadcast(
                tf.convert_to_tensor(tensor), timeout=self._options.timeout_seconds
            )
        return _tf_internal.simple_broadcast(value, destinations, always_mirrored=True)

    def broadcast_from_root(self, tensor: tf.Tensor) -> tf.Tensor:
        """``tensor`` as rank 0 has it, on every rank (used for initial values)."""
        return self._mpi.broadcast(tensor, timeout=self._options.timeout_seconds)


# Element-wise ops that give every rank the same result from the same inputs.
_DETERMINISTIC_OPS = frozenset(
    {
        "Identity",
        "Cast",
        "AddV2",
        "Add",
        "Sub",
        "Mul",
        "Neg",
        "Maximum",
        "Minimum",
        "FloorDiv",
        "FloorMod",
        "RealDiv",
    }
)


def _constants_if_same_on_every_rank(value: Any, variable: Any) -> list[np.ndarray] | None:
    """The constants ``value`` is made of, if it is the same on every rank; else None.

    Same on every rank: a constant of the program (a Python number, a numpy
    array) - if every rank has the same one, which the caller checks - or, in a
    tf.function, a new value of ``variable`` (a mirrored variable, so the same
    on every rank) computed from it and from constants of the graph by
    deterministic element-wise ops, as ``variable + 1`` is. A value made of
    graph constants alone may be the replica's id: it is sent.
    """
    if isinstance(value, (int, float, bool, np.ndarray, np.generic)):
        return [np.asarray(value)]
    constants: list[np.ndarray] = []
    reads: list[Any] = []
    if _made_of(value, variable, constants, reads, depth=6) and reads:
        return constants
    return None


def _made_of(
    value: Any, variable: Any, constants: list[np.ndarray], reads: list[Any], depth: int
) -> bool:
    """True if graph tensor ``value`` is made only of constants (appended to
    ``constants``) and reads of ``variable`` (appended to ``reads``)."""
    if not isinstance(value, tf.Tensor) or hasattr(value, "numpy") or not depth:
        return False  # an eager tensor: its value may come from anywhere
    op = value.op
    if op.type == "Const":
        constants.append(tf.get_static_value(value))
        return True
    if op.type == "ReadVariableOp" and _reads(op.inputs[0], variable):
        reads.append(op)
        return True
    return op.type in _DETERMINISTIC_OPS and all(
        _made_of(t, variable, constants, reads, depth - 1) for t in op.inputs
    )


def _reads(handle: Any, variable: Any) -> bool:
    """True if ``handle`` (in a tf.function) is the handle of one of ``variable``'s copies."""
    while handle is not None and not hasattr(handle, "numpy"):  # up through nested graphs
        handle = _tf_internal.captured_value(handle)
    handles = [getattr(v, "handle", None) for v in getattr(variable, "values", ())]
    return handle is not None and any(handle is h for h in handles)


# Dense values that ride along with sparse ones (see all_reduce_values): at
# most this many bytes per rank, of a dtype MPI sums exactly.
_RIDE_ALONG_BYTES = 64 * 1024
_SUMMABLE = (tf.float32, tf.float64, tf.int32, tf.int64)


def _local_values(value: Any) -> list[Any]:
    if isinstance(value, tf.distribute.DistributedValues):
        return list(value.values)
    return [value]


def _is_sparse(value: Any) -> bool:
    return isinstance(value, tf.IndexedSlices)


def dense_local_sum(value: Any) -> tf.Tensor:
    """``value`` (a per-replica value, or one replica's) summed over this
    rank's replicas as ``all_reduce_values`` sums them before MPI
    (``IndexedSlices`` made dense)."""
    return _local_sum([tf.convert_to_tensor(v) for v in _local_values(value)])


def _local_sum(parts: Sequence[Any]) -> tf.Tensor:
    if len(parts) == 1:
        return tf.convert_to_tensor(parts[0])
    with tf.device(parts[0].device):
        return tf.add_n(parts)


def _divide(value: Any, n: int) -> Any:
    # Same arithmetic as TF's own MEAN (so integer MEAN yields float64 as in TF).
    if isinstance(value, tf.IndexedSlices):
        return tf.IndexedSlices(value.values / n, value.indices, value.dense_shape)
    return value / n
