"""The engines that turn one collective into TensorFlow ops, and which runs what.

``OrderedComm`` describes each collective once (a ``Collective``) and asks its
engines, in order, which runs it: the first whose ``runs`` says yes. Every
engine sends the same bytes in the same MPI calls (``core/protocol.py``), so
ranks whose collectives ran on different engines still meet correctly.

- ``NativeEngine``: compiled kernels (``native/``), for each collective
  that declares one (``core/collective_ops/<name>.py``, its ``native``),
  when its shapes are known when tracing and its
  ``NativeOp.runs`` says so; also with a ``timeout_seconds`` (polled and the
  missing ranks announced in C: ``kernels/timeouts.cc``) and while a
  timeline records (timestamps taken in C, the events written by Python:
  ``Event.TRACE``).
- ``PythonEngine``: a ``tf.numpy_function`` calling the collective's
  ``numpy`` (``core/collective_ops/``); runs everything.

Both dispatch from that registry (``collective_ops.get``: a kind no module
declares raises ``ValueError`` on both), once per op, when tracing. What
only the Python engine runs, and why: shapes unknown when tracing (a
kernel's agreement record, its static part, is fixed when tracing), and
what a collective's ``NativeOp.runs`` refuses (e.g. an alltoall without one
row per rank, a reduce-scatter of a scalar: the Python engine raises their
errors).

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

from mpi_strategy._src.core import collective_ops, timeline as timeline_lib
from mpi_strategy._src.core.collectives import ArrayCollectives
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

    kind: str  # its module's name in core/collective_ops (CollectiveOp.name), e.g. "allreduce"
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
        next_token, summed = self._op(c, self._numpy(c), token, [flat], [flat.dtype])
        parts = tf.split(summed, [math.prod(shape) for shape in shapes])
        return [next_token, *(unknown_to_grappler(tf.reshape(p, s)) for p, s in zip(parts, shapes))]

    def _numpy(self, c: Collective) -> Callable[..., Sequence[np.ndarray]]:
        """The numpy function ``(token, *arrays) -> outputs`` of ``c`` (its
        module's ``numpy``; a kind no module declares raises)."""
        spec, run = collective_ops.get(c.kind), self._collectives
        return lambda token, *arrays: spec.numpy(run, c, token, *arrays)


class NativeEngine:
    """The compiled kernels of one communicator (``native/engine.py``)."""

    name = "native"
    device = HOST

    def __init__(self, kernels: NativeComm) -> None:
        self._kernels = kernels

    def runs(self, collective: Collective) -> bool:
        # (the Python engine runs, and explains, what a kernel does not: see
        # each collective's NativeOp.runs)
        native = collective_ops.get(collective.kind).native
        return (
            native is not None
            and collective.shapes is not None
            and native.runs(collective, self._kernels.size)
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
        return self._kernels.run(collective_ops.get(c.kind), c, token, inputs)


def unknown_to_grappler(tensor: tf.Tensor) -> tf.Tensor:
    """``tensor`` with a shape TensorFlow's graph optimizer (Grappler) does not
    know, as a kernel's output (``NativeEngine``: no shape function) has; its
    static shape stays known to Python. Where every shape in a product is
    known, Grappler's arithmetic optimizer may reorder the product
    (``lr * gradient * rsqrt(...)`` of tf_keras's RMSprop), which changes the
    last bits: a result must not depend on the engine, nor on the collective
    (all-reduce, or reduce-scatter and slicing) its operands came from."""
    hidden = tf.compat.v1.placeholder_with_default(tensor, shape=None)
    hidden.set_shape(tensor.shape)
    return hidden
