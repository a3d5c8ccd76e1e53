"""MPI collectives as TensorFlow ops that every rank issues in the same order.

MPI matches collectives by call order only. Each collective here is one
stateful op (a compiled kernel or a ``tf.numpy_function``: ``engines.py``)
that reads and writes a per-communicator *ordering token* (a scalar resource
variable). TensorFlow orders all ops that
touch the same resource in program order, across ``tf.cond``, ``tf.while_loop``
and nested function calls, so the collectives of one communicator run strictly
one after another, in the order the program issued them, on every rank. This
is the same device TensorFlow uses for its own collectives (an ordering token
passed to ``CollectiveReduceV2``).

Inside each op, the ranks first agree on what the collective is
(``agreement.py``): a mismatch raises the same error on every rank, and an
optional timeout names the ranks that never arrived. These errors are raised
in the op (on the kernels' error path, in Python too), so inside
``tf.function`` TensorFlow hands them to the caller as ``tf.errors`` classes
(``tf_errors.py`` says which). Data
crosses MPI as raw buffers, never as pickles.
"""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Sequence

import numpy as np
import tensorflow as tf
from mpi4py import MPI

from mpi_strategy._src import _tf_internal
from mpi_strategy._src.core.agreement import Agreement, ErrorClass
from mpi_strategy._src.core.collective_ops import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    ALLTOALLV,
    BARRIER,
    BROADCAST,
    REDUCESCATTER,
    CollectiveOp,
)
from mpi_strategy._src.core.collectives import ArrayCollectives
from mpi_strategy._src.core.errors import MPIStrategyError, RanksLostError
from mpi_strategy._src.distribute.engines import (
    HOST,
    Collective,
    Engine,
    NativeEngine,
    PythonEngine,
)
from mpi_strategy._src.distribute.tf_errors import CollectiveMismatchError, CollectiveTimeoutError
from mpi_strategy._src.native import engine as native_engine


class OrderedComm:
    """The graph-safe MPI operations of one communicator.

    Every method returns tensors holding the same value on every rank of
    ``comm``. In eager mode the call runs immediately; inside ``tf.function``
    it becomes one stateful op ordered after the previous MPI op of this
    communicator.
    """

    def __init__(
        self,
        comm: MPI.Intracomm,
        name_missing_ranks: bool = False,
        mismatch_error: ErrorClass = CollectiveMismatchError,
        timeout_error: ErrorClass = CollectiveTimeoutError,
    ) -> None:
        """Collective over ``comm``: every rank of it creates its OrderedComm
        at the same point; the collectives run on their own duplicates of
        ``comm`` (``core.collectives.ArrayCollectives``). ``name_missing_ranks``:
        make timeouts name the ranks that never arrived. ``mismatch_error``,
        ``timeout_error``: what a disagreement and a timeout raise (eager;
        see ``errors.py`` for inside ``tf.function``)."""
        self.collectives = ArrayCollectives(comm, name_missing_ranks, mismatch_error, timeout_error)
        self.comm: MPI.Intracomm = self.collectives.comm
        self.rank, self.size = self.collectives.rank, self.collectives.size
        self._token_variable: tf.Variable | None = None
        with tf.init_scope():
            if tf.executing_eagerly():  # else at first eager use (not in a TF1 graph)
                self._token_variable = self._new_token()
        # TensorFlow 1 graphs (no variable to initialize there): the last
        # collective of each graph, and how many it has had.
        kernels = native_engine.kernels() if self.size > 1 else None
        # Asked in order which runs each collective: the kernels where built.
        self._engines: list[Engine] = [PythonEngine(self.collectives)]
        if kernels is not None:
            native = native_engine.NativeComm(kernels, self.collectives)
            self._engines.insert(0, NativeEngine(native))
        self._chains: weakref.WeakKeyDictionary[tf.Graph, tuple[tf.Tensor, int]] = (
            weakref.WeakKeyDictionary()
        )

    @property
    def _token(self) -> tf.Variable:
        """The ordering token (made here at first use if the communicator was
        created in a TensorFlow 1 graph)."""
        if self._token_variable is None:
            self._token_variable = self._new_token()
        return self._token_variable

    @staticmethod
    def _new_token() -> tf.Variable:
        # A plain (non-distributed) variable, outside any tf.function, on the host.
        with tf.init_scope(), tf.device(HOST):
            return tf.Variable(
                np.int64(0),
                trainable=False,
                name="mpi_ordering_token",
                synchronization=tf.VariableSynchronization.NONE,
            )

    @property
    def agreement(self) -> Agreement:
        """The agreement every collective (and every meeting) of this communicator starts with."""
        return self.collectives.agreement

    @property
    def failed(self) -> bool:
        """True once a rank of this communicator died (``RanksLostError``)."""
        return self.collectives.failed

    def ranks_lost(self, error: MPI.Exception) -> RanksLostError:
        """Marks the communicator failed and revokes it; returns the error to raise."""
        return self.collectives.ranks_lost(error)

    @property
    def engines(self) -> tuple[str, ...]:
        """The engines asked, in order, which runs each collective ("native", "python")."""
        return tuple(engine.name for engine in self._engines)

    # -- the one place a TF op calls MPI -------------------------------------
    def _ordered_call(self, collective: Collective, inputs: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Runs ``collective`` on ``inputs`` as one op ordered after the
        previous collective of this communicator, on the first engine that
        runs it. Its ordering token (an int, the same on every rank) goes into
        the agreement, so that ranks whose earlier constants differed raise."""
        engine = next(e for e in self._engines if e.runs(collective))
        if not tf.executing_eagerly() and _in_graph_v1():  # (eager: never; cheap first)
            return self._graph_v1_call(engine, collective, inputs)
        with tf.device(engine.device):
            token = self._token.read_value()
            outputs = engine(collective, token, inputs)
            self._token.assign(outputs[0])
        return list(outputs[1:])

    def _graph_v1_call(
        self, engine: Engine, collective: Collective, inputs: Sequence[tf.Tensor]
    ) -> list[tf.Tensor]:
        """In a TensorFlow 1 graph, each collective runs after the graph's
        previous one (a control dependency), numbered in the order built."""
        graph = tf.compat.v1.get_default_graph()
        last, count = self._chains.get(graph, (None, 0))
        with tf.device(engine.device), tf.control_dependencies([] if last is None else [last]):
            outputs = engine(collective, tf.constant(np.int64(count)), inputs)
        self._chains[graph] = (outputs[0], count + 1)
        return list(outputs[1:])

    # -- collectives -----------------------------------------------------------
    def allreduce_sum(self, x: tf.Tensor, timeout: float | None = None) -> tf.Tensor:
        """Element-wise sum of ``x`` over all ranks (every rank gets the sum).

        ``timeout``: seconds to wait for the other ranks to reach this
        collective before raising (None: wait as long as MPI does, forever).
        """
        return self.allreduce_sum_packed([x], timeout)[0]

    def allreduce_sum_packed(
        self, tensors: Sequence[tf.Tensor], timeout: float | None = None
    ) -> list[tf.Tensor]:
        """``allreduce_packed`` with ``op="sum"``."""
        return self.allreduce_packed(tensors, "sum", timeout)

    def allreduce_packed(
        self, tensors: Sequence[tf.Tensor], op: str = "sum", timeout: float | None = None
    ) -> list[tf.Tensor]:
        """Reduces each of ``tensors`` (all of one dtype) over all ranks with
        ``op`` ("sum", "min", "max" or "product"), in one MPI call.

        The tensors are copied into one pooled buffer, summed in place by one
        MPI call and handed back as aligned views of it, which TensorFlow
        adopts without a copy (``core/buffers.py``): one copy in, none out, and the
        same memory every step once TensorFlow has let go of the previous one.
        Many small tensors (a small model's gradients) are concatenated by
        TensorFlow first: each tensor that crosses into Python costs several
        microseconds, more than copying a few hundred kB.
        """
        contiguous = len(tensors) > 1 and _small_and_static(tensors)
        return self._run(ALLREDUCE, tensors, op=op, contiguous=contiguous, timeout=timeout)

    def allgather(self, x: tf.Tensor, timeout: float | None = None) -> tf.Tensor:
        """Concatenation along axis 0 of ``x`` from every rank, in rank order.

        Ranks may contribute different numbers of rows; the other dimensions
        and the dtype must agree (checked on every rank, so all ranks raise).
        """
        return self.allgather_many([x], timeout)[0]

    def allgather_many(
        self, tensors: Sequence[tf.Tensor], timeout: float | None = None
    ) -> list[tf.Tensor]:
        """``allgather`` of each of ``tensors``, in one MPI call.

        The tensors may differ in dtype and shape; each is concatenated along
        axis 0 over the ranks, in rank order, and may have a different number
        of rows on each rank. One ``Allgatherv`` of bytes carries them all.
        """
        return self._run(ALLGATHER, tensors, timeout=timeout)

    def alltoall(self, x: tf.Tensor, timeout: float | None = None) -> tf.Tensor:
        """Row ``r`` of ``x`` goes to rank ``r``: the result's row ``r`` is what
        rank ``r`` sent to this rank. ``x`` has ``size`` rows, of the same
        shape and dtype on every rank.
        """
        return self._run(ALLTOALL, [x], timeout=timeout)[0]

    def broadcast(self, x: tf.Tensor, root: int = 0, timeout: float | None = None) -> tf.Tensor:
        """``x`` as it is on ``root``, on every rank.

        Raises on every rank if the ranks' tensors differ in size or dtype,
        since that means the ranks are not running the same program (e.g. a
        model built differently on one rank).
        """
        return self._run(BROADCAST, [x], root=root, timeout=timeout)[0]

    def reducescatter(
        self, x: tf.Tensor, op: str = "sum", timeout: float | None = None
    ) -> tf.Tensor:
        """``x`` (one shape and dtype on every rank) reduced with ``op``; this
        rank gets its share of the rows (``core.collectives.row_split``)."""
        return self._run(REDUCESCATTER, [x], op=op, timeout=timeout)[0]

    def alltoallv(
        self, x: tf.Tensor, splits: tf.Tensor, timeout: float | None = None
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """The first ``splits[r]`` rows after those for lower ranks go to rank
        ``r``; returns (the rows received, in rank order; how many from each rank)."""
        out, received = self._run(ALLTOALLV, [x, tf.cast(splits, tf.int64)], timeout=timeout)
        return out, received

    def barrier(self, timeout: float | None = None) -> tf.Tensor:
        """Returns (a scalar 0) once every rank has reached it."""
        return self._run(BARRIER, [], timeout=timeout)[0]

    def _run(
        self,
        spec: CollectiveOp,
        inputs: Sequence[tf.Tensor],
        *,
        op: str = "sum",
        root: int = 0,
        contiguous: bool = False,
        timeout: float | None = None,
    ) -> list[tf.Tensor]:
        """The collective ``spec`` (``core/collective_ops/``) of ``inputs``, as
        one ordered op (``timeout``: seconds, None for MPI's own wait); its
        outputs' shapes set as far as known when tracing. Runs when tracing."""
        _check_not_xla(spec.name)
        if self.size == 1 and spec.identity_on_one_rank:
            return [tf.identity(t) for t in inputs]
        spec.check([np.dtype(t.dtype.as_numpy_dtype) for t in inputs])
        dims = [None if t.shape.rank is None else tuple(t.shape.as_list()) for t in inputs]
        if spec.output_dtypes is None:
            output_dtypes = tuple(t.dtype for t in inputs)
        else:
            output_dtypes = tuple(tf.as_dtype(d) for d in spec.output_dtypes)
        outs = self._ordered_call(
            Collective(
                spec.name,
                spec.op_name,
                output_dtypes,
                op=op,
                root=root,
                shapes=spec.agreed(dims),
                contiguous=contiguous,
                timeout=timeout,
            ),
            inputs,
        )
        for out, shape in zip(outs, spec.output_shapes(dims, self.size)):
            out.set_shape(shape)
        return outs

    def check_same_constants(self, arrays: Sequence[np.ndarray]) -> None:
        """Checks, at the next collective, that ``arrays`` (constants of the
        program, numpy arrays) are the same on every rank, without sending them.

        The ordering token advances by a hash of their values; the tokens are
        part of the next collective's signature, where ranks that held
        different constants raise ``CollectiveMismatchError``.
        """
        if self.size == 1 or not arrays or _in_graph_v1():
            return
        digest = 0
        for array in arrays:
            digest = zlib.crc32(f"{array.dtype}{array.shape}".encode() + array.tobytes(), digest)
        with tf.device(HOST):
            self._token.assign_add(digest & _CONSTANT_HASH_MASK)


# 24 bits per constant: the token (an int64) does not overflow in 2^39 steps.
_CONSTANT_HASH_MASK = (1 << 24) - 1


# Up to this many bytes, TensorFlow concatenates many tensors into one before
# they cross into Python (see allreduce_sum_packed).
_CONCAT_IN_GRAPH_BYTES = 256 * 1024


def _in_graph_v1() -> bool:
    """Whether ops are being built into a TensorFlow 1 graph (run by a Session)."""
    with tf.init_scope():
        return not tf.executing_eagerly()


def _small_and_static(tensors: Sequence[tf.Tensor]) -> bool:
    if not all(t.shape.is_fully_defined() for t in tensors):
        return False
    return sum(t.shape.num_elements() * t.dtype.size for t in tensors) <= _CONCAT_IN_GRAPH_BYTES


def _check_not_xla(name: str) -> None:
    # Checked even on one rank, so a program fails the same way at 1 and N ranks.
    if _tf_internal.in_xla_context():
        raise MPIStrategyError(
            f"mpi_strategy: the MPI collective {name} cannot be compiled by XLA. "
            "Remove jit_compile=True from the tf.function (for Keras: "
            "model.compile(..., jit_compile=False)); XLA can still compile "
            "functions that do not communicate, e.g. the model's forward pass."
        )
