"""The engines that turn one collective into TensorFlow ops, and which runs what.

``OrderedComm`` describes each collective once (a ``Collective``) and asks its
engines, in order, which runs it: the first whose ``runs`` says yes. Every
engine sends the same bytes in the same MPI calls (``core/protocol.py``), so
ranks whose collectives ran on different engines still meet correctly.

- ``NativeEngine``: compiled kernels (``native/``), for the all-reduce, the
  broadcast, the all-gather, the alltoall (equal splits and with splits),
  the reduce-scatter and the barrier, when their shapes are known when
  tracing; also with a ``timeout_seconds`` (polled and the missing ranks
  announced in C: ``kernels/timeouts.cc``) and while a timeline records
  (timestamps taken in C, the events written by Python: ``Event.TRACE``).
- ``PythonEngine``: a ``tf.numpy_function`` calling ``core/collectives.py``;
  runs everything.

What only the Python engine runs, and why (the one place this is listed):
shapes unknown when tracing (a kernel's agreement record, its static part,
is fixed when tracing); an alltoall without one row per rank and a
reduce-scatter of a scalar (the Python engine raises their errors).

An engine declares the device its ops run on (``device``): a GPU engine would
be a third implementation of ``Engine`` whose kernels are registered for
``DEVICE_GPU`` (docs/concepts.md, "Two engines").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import tensorflow as tf

from mpi_strategy._src.core import timeline as timeline_lib
from mpi_strategy._src.core.collectives import ArrayCollectives
from mpi_strategy._src.native import engine as native_engine
from mpi_strategy._src.native.engine import NativeComm

Shapes = tuple[tuple[int, ...], ...]
Outputs = Sequence[tf.Tensor]  # [next ordering token, *results]

HOST = "/device:CPU:0"


@dataclass(frozen=True)
class Collective:
    """One collective as the binding asks for it, whatever engine runs it.

    ``shapes``: what the agreement compares, when known when tracing (the
    tensors' shapes; an all-gather's row shapes), else None. ``contiguous``:
    several small tensors of one all-reduce, sent as the bytes of their
    concatenation. ``timeout``: seconds (None: wait as long as MPI does).
    """

    kind: str  # allreduce, allgather, broadcast, alltoall, alltoallv, reducescatter, barrier
    name: str  # the op's name, e.g. "MPIAllreduce"
    output_dtypes: tuple[tf.DType, ...]
    op: str = "sum"
    root: int = 0
    shapes: Shapes | None = None
    contiguous: bool = False
    timeout: float | None = None


class Engine(Protocol):
    """How collectives become TensorFlow ops on one communicator."""

    name: str
    device: str  # where its ops run

    def runs(self, collective: Collective) -> bool:
        """Whether this engine can run ``collective`` (asked once, when tracing)."""
        ...

    def __call__(self, collective: Collective, token: tf.Tensor, inputs: Outputs) -> Outputs:
        """``collective`` on ``inputs``: [next token, *outputs], the token one more."""
        ...


class PythonEngine:
    """Every collective, as one stateful ``tf.numpy_function`` per call."""

    name = "python"
    device = HOST

    def __init__(self, collectives: ArrayCollectives) -> None:
        self._collectives = collectives

    def runs(self, collective: Collective) -> bool:
        return True

    def __call__(self, collective: Collective, token: tf.Tensor, inputs: Outputs) -> Outputs:
        if collective.contiguous:  # (concatenated by TensorFlow: one tensor crosses)
            return self._concatenated(collective, token, inputs)
        return self._op(
            collective, self._numpy(collective), token, inputs, collective.output_dtypes
        )

    def _op(
        self,
        collective: Collective,
        fn: Callable[..., Sequence[np.ndarray]],
        token: tf.Tensor,
        inputs: Outputs,
        output_dtypes: Sequence[tf.DType],
    ) -> Outputs:
        """``fn(token, *arrays)`` as one stateful op taking and returning the token."""
        trace = timeline_lib.current()
        if trace is not None:
            fn = self._collectives.timed(fn, collective.name, trace)
        guarded = self._collectives.guarded(fn)

        def with_token(token: np.ndarray, *arrays: np.ndarray) -> list[Any]:
            return [token + 1, *guarded(int(token), *arrays)]

        return tf.numpy_function(
            with_token,
            [token, *inputs],
            [tf.int64, *output_dtypes],
            stateful=True,
            name=collective.name,
        )

    def _concatenated(self, c: Collective, token: tf.Tensor, inputs: Outputs) -> Outputs:
        """Several small tensors reduced as one flat tensor; the agreement
        compares their shapes (``c.shapes``)."""
        assert c.shapes is not None
        shapes = list(c.shapes)
        flat = tf.concat([tf.reshape(t, [-1]) for t in inputs], axis=0)
        run = self._collectives
        next_token, summed = self._op(
            c,
            lambda token, array: run.allreduce([array], c.op, shapes, c.timeout, token),
            token,
            [flat],
            [flat.dtype],
        )
        parts = tf.split(summed, [math.prod(shape) for shape in shapes])
        return [next_token, *(tf.reshape(p, s) for p, s in zip(parts, shapes))]

    def _numpy(self, c: Collective) -> Callable[..., Sequence[np.ndarray]]:
        """The numpy function ``(token, *arrays) -> outputs`` of ``c``."""
        run = self._collectives
        if c.kind == "allreduce":
            return lambda token, *arrays: run.allreduce(arrays, c.op, None, c.timeout, token)
        if c.kind == "allgather":
            return lambda token, *arrays: run.allgather(arrays, c.timeout, token)
        if c.kind == "broadcast":
            return lambda token, array: [run.broadcast(array, c.root, c.timeout, token)]
        if c.kind == "alltoall":
            return lambda token, array: [run.alltoall(array, c.timeout, token)]
        if c.kind == "alltoallv":
            return lambda token, array, counts: list(
                run.alltoallv(array, counts.tolist(), c.timeout, token)
            )
        if c.kind == "reducescatter":
            return lambda token, array: [run.reducescatter(array, c.op, c.timeout, token)]
        if c.kind == "barrier":
            return lambda token: _after(run.barrier, c.timeout, token)
        raise ValueError(f"mpi_strategy: no collective kind {c.kind!r}")


def _after(
    wait: Callable[[float | None, int], None], timeout: float | None, token: int
) -> list[np.ndarray]:
    wait(timeout, token)
    return [np.int32(0)]


class NativeEngine:
    """The compiled kernels of one communicator (``native/engine.py``)."""

    name = "native"
    device = HOST
    KINDS = frozenset(kind for kind, _ in native_engine.OP_TYPES)

    def __init__(self, kernels: NativeComm) -> None:
        self._kernels = kernels

    def runs(self, collective: Collective) -> bool:
        shapes = collective.shapes
        return (
            collective.kind in self.KINDS
            and shapes is not None
            # (the Python engine explains an alltoall without one row per rank,
            # and a reduce-scatter of a scalar)
            and (collective.kind != "alltoall" or shapes[0][:1] == (self._kernels.size,))
            and (collective.kind != "reducescatter" or len(shapes[0]) > 0)
        )

    def __call__(self, collective: Collective, token: tf.Tensor, inputs: Outputs) -> Outputs:
        if not tf.executing_eagerly():
            return self._kernel(collective, token, inputs)
        try:
            return self._kernel(collective, token, inputs)
        except tf.errors.OpError:
            # Eager: the Python engine's exception itself (its class, e.g.
            # CollectiveMismatchError), which the kernel's error path kept.
            original = self._kernels.take_error()
            if original is None:
                raise
            raise original from None

    def _kernel(self, c: Collective, token: tf.Tensor, inputs: Outputs) -> Outputs:
        assert c.shapes is not None
        kernels, timeout = self._kernels, c.timeout
        if c.kind == "allreduce":
            return kernels.allreduce(token, inputs, c.op, c.shapes, c.contiguous, timeout)
        if c.kind == "broadcast":
            return kernels.broadcast(token, inputs[0], c.root, timeout)
        if c.kind == "alltoall":
            return kernels.alltoall(token, inputs[0], timeout)
        if c.kind == "alltoallv":
            return kernels.alltoallv(token, inputs[0], inputs[1], timeout)
        if c.kind == "reducescatter":
            return kernels.reducescatter(token, inputs[0], c.op, timeout)
        if c.kind == "barrier":
            return kernels.barrier(token, timeout)
        if c.kind == "allgather":
            return kernels.allgather(token, inputs, timeout)
        raise ValueError(f"mpi_strategy: no native kernel for collective kind {c.kind!r}")
