"""What one collective declares (``CollectiveOp``), and the rules several share.

Each collective is one module of this package, framework-free: its agreement
kind, its numpy implementation (the Python engine), the agreement's tag and
dtypes (one definition for both engines), its shape rules (what the agreement
compares when known when tracing; its outputs' shapes), and its native op
(``native/kernels/<name>.cc``: the op type, its attributes, when the kernels
run it). The engines (``distribute/engines.py``), ``NativeComm.run`` and
``OrderedComm._run`` interpret these alike on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from mpi4py import MPI
from numpy.typing import DTypeLike

from mpi_strategy._src.core.kinds import Kind
from mpi_strategy._src.core.protocol import as_int64

if TYPE_CHECKING:  # (agreement.py imports the kinds declared here)
    from mpi_strategy._src.core.agreement import Agreement, ErrorClass
    from mpi_strategy._src.core.buffers import BufferPool

Shapes = tuple[tuple[int, ...], ...]
# A shape as known when tracing (None: unknown size; the whole None: unknown rank).
Dims = tuple[int | None, ...] | None


class Params(Protocol):
    """How one call of a collective was asked for (``distribute.engines.Collective``
    is one; ``Call`` another): the same on every rank."""

    @property
    def op(self) -> str: ...
    @property
    def root(self) -> int: ...
    @property
    def shapes(self) -> Shapes | None: ...
    @property
    def contiguous(self) -> bool: ...
    @property
    def timeout(self) -> float | None: ...


class Runner(Protocol):
    """What a collective's numpy implementation uses of its communicator
    (an ``ArrayCollectives``, ``core/collectives.py``)."""

    agreement: Agreement
    comm: MPI.Intracomm
    rank: int
    size: int

    @property
    def pool(self) -> BufferPool: ...
    @property
    def mismatch_error(self) -> ErrorClass: ...
    def bad_splits(self, matrix: np.ndarray, counts: list[int], rows: int) -> Exception: ...


@dataclass(frozen=True)
class Call:
    """``Params`` of a direct call on numpy arrays (``ArrayCollectives``' methods)."""

    op: str = "sum"
    root: int = 0
    shapes: Shapes | None = None
    contiguous: bool = False
    timeout: float | None = None


def no_attrs(p: Params, dtypes: Sequence[np.dtype]) -> dict[str, int]:
    return {}


def always(p: Params, size: int) -> bool:
    return True


@dataclass(frozen=True)
class NativeOp:
    """A collective's compiled kernel (registered by ``native/kernels/<name>.cc``).

    ``inputs``: the op's arguments after the token, bound in order to the
    collective's tensors ("inputs": all of them, as one list). ``listed``:
    its outputs after the token are one list. ``attrs``: its own attributes
    (beyond the agreement record's, ``NativeComm._site``), from the call and
    the agreement's dtypes. ``reads``: those of them its kernel reads (names
    of ``protocol.ATTRS`` that have a C++ default): every call must pass each,
    checked while tracing (left out, one would silently be its default, e.g. a
    broadcast from rank 0). ``runs``: whether the kernels run a call whose
    shapes are known when tracing (else the Python engine runs it: and
    raises its error)."""

    type: str
    inputs: tuple[str, ...] = ("input",)
    listed: bool = False
    attrs: Callable[[Params, Sequence[np.dtype]], dict[str, int]] = no_attrs
    reads: tuple[str, ...] = ()
    runs: Callable[[Params, int], bool] = always


def no_tag(p: Params) -> str:
    return ""


def first_dtype(dtypes: Sequence[np.dtype]) -> list[np.dtype]:
    return [np.dtype(dtypes[0])]


def every_dtype(dtypes: Sequence[np.dtype]) -> list[np.dtype]:
    return [np.dtype(d) for d in dtypes]


def no_check(dtypes: Sequence[np.dtype]) -> None:
    return None


@dataclass(frozen=True)
class CollectiveOp:
    """Everything about one collective that is not a framework's.

    ``name``: the dispatch key (``engines.Collective.kind``); ``op_name``: the
    TensorFlow op's name on both engines, the timeline's. ``kind``: the
    agreement's kind for a call; ``tag``: the agreement's tag; ``dtypes``:
    the dtypes the agreement compares, from the tensors'. ``numpy(run, p,
    token, *arrays)``: the Python engine (``run``: a ``Runner``),
    a list of arrays. ``agreed(dims)``: the shapes the agreement compares
    when known when tracing, else None; ``output_shapes(dims, size)``: the
    outputs' shapes as known when tracing. ``output_dtypes``: None for the
    inputs'. ``identity_on_one_rank``: a 1-rank call returns its inputs.
    ``check(dtypes)``: raises for dtypes it cannot take. ``native``: its
    kernel (None: the Python engine only)."""

    name: str
    op_name: str
    kind: Callable[[Params], Kind]
    numpy: Callable[..., list[np.ndarray]]
    agreed: Callable[[Sequence[Dims]], Shapes | None]
    output_shapes: Callable[[Sequence[Dims], int], list[Dims]]
    tag: Callable[[Params], str] = no_tag
    dtypes: Callable[[Sequence[np.dtype]], list[np.dtype]] = first_dtype
    output_dtypes: tuple[str, ...] | None = None
    identity_on_one_rank: bool = False
    check: Callable[[Sequence[np.dtype]], None] = no_check
    native: NativeOp | None = None


# -- shape rules -------------------------------------------------------------
def whole(dims: Sequence[Dims]) -> Shapes | None:
    """The tensors' shapes, when every one is known."""
    known = [d for d in dims if d is not None and None not in d]
    if len(known) != len(dims):
        return None
    return tuple(tuple(n for n in d if n is not None) for d in known)


def beyond_rows(dims: Sequence[Dims]) -> Shapes | None:
    """The tensors' shapes beyond axis 0 (a scalar's: ()), when every one is known."""
    if any(d is None for d in dims):
        return None
    return whole([d[1:] for d in dims if d is not None])


def same(dims: Sequence[Dims], size: int) -> list[Dims]:
    """The outputs have the inputs' shapes."""
    return list(dims)


def rows_unknown(dims: Sequence[Dims], size: int) -> list[Dims]:
    """The inputs' shapes with axis 0 unknown (row counts that differ per rank)."""
    return [None if d is None else (None, *d[1:]) for d in dims]


# -- the MPI handles attributes carry ------------------------------------------
def mpi_dtype(dtype: DTypeLike) -> int:
    """The MPI datatype of ``dtype``, as an op attribute."""
    return as_int64(MPI.Datatype.fromcode(np.dtype(dtype).char).handle)


def mpi_handle(handle: Any) -> int:
    """An MPI object's handle (e.g. an ``MPI.Op``), as an op attribute."""
    return as_int64(handle.handle)
