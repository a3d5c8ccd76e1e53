"""What a collective or a meeting is (its ``Kind``), and the words for it.

Every agreement (``agreement.py``) sends a kind's ``code`` in its record;
this module holds the registry of kinds (each module that defines one
registers it at import, alike on every rank), and the texts that a
disagreement or a timeout shows: what each rank was doing (``describe``)
and what to do about it (each kind's advice, ``ORDER_ADVICE``,
``CONSTANT_ADVICE``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from mpi_strategy._src.core.protocol import Field, Shape, dtype_name


@dataclass(frozen=True)
class Kind:
    """What a collective or a meeting is, for the agreement and its messages.

    ``advice``: what to do when the ranks all entered this kind but disagree.
    ``meeting``: no data (a meeting of the ranks, e.g. around a save);
    described by its name alone. ``partial``: some ranks may enter it without
    the others (``agree`` returns None there: they go on alone, see
    ``Agreement.agree``); ``solo_label`` and ``solo_advice`` then describe a
    collective such a rank makes meanwhile. ``blame``: the advice when a rank
    in this kind meets ranks in another (it names the likely cause).
    ``wording``: the signature in words, when ``describe``'s do not fit.
    ``own_bytes``: each rank brings its own number of bytes (an all-gather):
    agreed by hash, those are exchanged too (no record says them).
    """

    code: int
    name: str
    advice: str = ""
    meeting: bool = False
    partial: bool = False
    solo_label: str = ""
    solo_advice: str = ""
    blame: str = ""
    wording: Callable[[np.ndarray], str] | None = None
    own_bytes: bool = False


# Every kind by its code: filled at import (alike on every rank), then only read.
_BY_CODE: dict[int, Kind] = {}


def register_kind(kind: Kind) -> Kind:
    """Makes ``kind`` known to every agreement (at import, alike on every rank)."""
    if _BY_CODE.get(kind.code, kind) != kind:
        raise ValueError(f"agreement kind code {kind.code} is taken by {_BY_CODE[kind.code]}")
    _BY_CODE[kind.code] = kind
    return kind


# (1-4, 8-13: the collectives' own, in their modules under collective_ops/;
# 5 and 6: a save and its end, features/saving/write_point.py)
FINALIZE = register_kind(Kind(7, "the end of the program", meeting=True))

# The collectives' kinds by their former names here, for callers that name them.
_MOVED = {
    "ALLREDUCE": ("allreduce", "KIND"),
    "ALLREDUCE_MIN": ("allreduce", "MIN"),
    "ALLREDUCE_MAX": ("allreduce", "MAX"),
    "ALLREDUCE_PRODUCT": ("allreduce", "PRODUCT"),
    "ALLGATHER": ("allgather", "KIND"),
    "BROADCAST": ("broadcast", "KIND"),
    "ALLTOALL": ("alltoall", "KIND"),
    "REDUCESCATTER": ("reducescatter", "KIND"),
    "ALLTOALLV": ("alltoallv", "KIND"),
    "BARRIER": ("barrier", "KIND"),
}


def __getattr__(name: str) -> Kind:
    """A collective's kind, declared in its module (``collective_ops/<name>.py``;
    imported here when asked: those modules import this one)."""
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _MOVED[name]
    found: Kind = getattr(
        importlib.import_module(f"{__package__}.collective_ops.{module}"), attribute
    )
    return found


ORDER_ADVICE = (
    "The ranks are running different collectives: every rank must run the same steps, "
    "in the same order. Common causes: reading a metric or calling strategy.reduce / "
    "gather on some ranks only (e.g. under `if rank == 0`), or ranks that build "
    "different models or take different branches in Python."
)
CONSTANT_ADVICE = (
    "The ranks agree on this collective but assigned different constants before it "
    "(since the previous collective of this communicator) to a variable whose "
    "aggregation is ONLY_FIRST_REPLICA, such as optimizer.iterations. Such a constant "
    "is not sent (a one-process program has one value for it): compute it the same "
    "way on every rank, or assign a tensor (which rank 0 then sends to every rank)."
)


def kind_of(code: int) -> Kind:
    """The kind registered under ``code`` (an unnamed one if none is)."""
    return _BY_CODE.get(int(code), Kind(int(code), f"collective kind {int(code)}"))


def describe(signature: np.ndarray) -> str:
    """What a signature means, in words (e.g. "allreduce of 10 float32 elements")."""
    of = kind_of(signature[Field.KIND])
    kind, dtype = of.name, dtype_name(int(signature[Field.DTYPE]))
    if of.meeting:
        return kind
    if signature[Field.SOLO]:
        kind = f"({kind_of(signature[Field.SOLO]).solo_label}) " + kind
    if of.wording is not None:
        return of.wording(signature)
    packed = f" in {signature[Field.TENSORS]} tensors" if signature[Field.TENSORS] != 1 else ""
    return f"{kind} of {signature[Field.COUNT]} {dtype} elements{packed}"


def shapes_text(shapes: Sequence[Shape]) -> str:
    text = ", ".join(str(tuple(int(d) for d in shape)) for shape in shapes[:4])
    return text + (f", ... ({len(shapes)} in all)" if len(shapes) > 4 else "")
