"""The agreement's wire protocol, written once for both engines.

Every collective starts with the agreement (``agreement.py``): each rank
sends a fixed-size *record*, an int64 *signature* (``Field``) followed by
carried data, and the ranks compare what must agree. The Python engine
(``collectives.py``) and the compiled kernels (``native/kernels/``) must
build, send and read these bytes alike, so that a rank on one meets a rank on
the other. This module is the one place those rules are written: the C++
side includes ``header()``, generated from these constants when the kernels
are built, and the loader refuses a library whose compiled constants
(``mpi_strategy_protocol()`` in it) differ from ``fingerprint()``.

What cannot be a constant is written once per engine and held equal by the
engine-equivalence tests (tests/any_world_size/native/test_native.py): the order in
which carried data is reduced (rank 0 first), the hash (``hash_of``), packing
several tensors (``PACK_ALIGN``) and the all-gather layout (``PIECE_ALIGN``).
"""

from __future__ import annotations

import enum
import functools
import math
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

Shape = Sequence[int]


class Field(enum.IntEnum):
    """The int64 fields of a signature, in order."""

    SEQ = 0  # the collective's number on this communicator
    KIND = 1  # which collective (agreement.Kind.code)
    DTYPE = 2  # the first tensor's dtype code
    COUNT = 3  # elements (per row for an all-gather)
    TENSORS = 4  # how many tensors are packed into it
    LAYOUT = 5  # a hash of every shape and dtype, and of a tag (a save's path)
    SOLO = 6  # the partial meeting this rank is in without the others (0: none)
    TOKEN = 7  # how far the ordering token moved since the previous collective
    ROWS = 8  # rows sent (all-gather only; may differ between ranks)
    BYTES = 9  # data bytes sent (may differ between ranks)
    NOTICE = 10  # this rank's preemption notice: a signal number, 0 for none


# KIND .. TOKEN must be equal on every rank; the other fields may differ.
MUST_AGREE = slice(Field.KIND, Field.TOKEN + 1)
SIGNATURE_BYTES = 8 * len(Field)


class State(enum.IntEnum):
    """The int64 fields of a communicator's shared state (``Agreement.state``),
    which the kernels read and write too; the ordering token serialises the
    collectives that touch it. The announcements' words follow it in the same
    block (``Agreement.block``) when ANNOUNCE_COMM is set."""

    SEQ = 0  # the number of the last collective
    TOKEN = 1  # the ordering token of the previous collective
    SOLO = 2  # the code of the partial meeting this rank is in alone (0: none)
    BLOCKED = 3  # nonzero: the kernels ask Python first (a retired communicator)
    AGREE_COMM = 4  # the MPI handle of the agreement's communicator
    DATA_COMM = 5  # the MPI handle of the data's communicator
    RECORD_BYTES = 6
    RANK = 7
    SIZE = 8
    ENGINE = 9  # which communicator, for the way back to Python
    CARRY_BYTES = 10
    HASHED = 11  # 1: the hashed agreement (more than HASHED_ABOVE ranks)
    NOTICE = 12  # this rank's preemption notice, sent in every record (0: none)
    NOTICED = 13  # the notice some rank sent, once an agreement carried it (0: none)
    NOTICED_AT = 14  # the collective whose agreement first carried it
    ANNOUNCE_COMM = 15  # the MPI handle of the announcements' communicator (0: none)


class Event(enum.IntEnum):
    """Why a kernel asks Python (its error path)."""

    DISAGREEMENT = 1
    MPI_ERROR = 2
    BLOCKED = 3
    BAD_SPLITS = 4  # an alltoall's splits do not cut some rank's tensor
    TIMEOUT = 5  # the agreement's exchange outlasted the collective's timeout
    TRACE = 6  # a timeline records: the kernel's timestamps, for Python to write


class Op(enum.IntEnum):
    """A reduction's operation, as the kernels number it."""

    SUM = 0
    MIN = 1
    MAX = 2
    PRODUCT = 3


FNV_OFFSET = 0xCBF29CE484222325  # the hashed agreement: 64-bit FNV-1a
FNV_PRIME = 0x100000001B3
PACK_ALIGN = 64  # each tensor packed into one reduction buffer starts this aligned
PIECE_ALIGN = 8  # each piece of an all-gather's message is padded to this
# The tag of the announcements (the number of each collective a rank enters
# with a timeout, one int64 to every other rank, ``timeouts.Announcements``).
ANNOUNCE_TAG = 7
# The hashed agreement (one 24-byte Allreduce of the largest hash, minus the
# smallest, and the largest notice) above this many ranks: gathering every
# record costs O(ranks) bytes per rank, which the cost model shows at
# thousands of ranks. Every record is gathered only to explain a disagreement.
HASHED_ABOVE = 1024


def record_bytes(size: int) -> int:
    """Bytes each rank sends in the agreement, on a communicator of ``size``.

    512 up to 32 ranks; less on larger communicators so that the all-gather
    stays about 16 KiB, but always room for a few scalars. The same on every rank.
    """
    return max(128, min(512, 16384 // max(size, 1) // 8 * 8))


def hash_of(signature: np.ndarray) -> int:
    """The hashed agreement's hash of what must agree in ``signature``
    (FNV-1a of its bytes, little-endian), below 2**63."""
    h = FNV_OFFSET
    for byte in signature[MUST_AGREE].astype("<i8").tobytes():
        h = ((h ^ byte) * FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return h >> 1


# A dtype's code in a signature: its index here (else 1000 + numpy's number).
DTYPES = [
    np.dtype(t)
    for t in (
        np.float32,
        np.float64,
        np.int32,
        np.int64,
        np.float16,
        np.bool_,
        np.uint8,
        np.int8,
        np.int16,
        np.uint16,
        np.uint32,
        np.uint64,
        np.complex64,
        np.complex128,
    )
]
_DTYPE_CODES = {d: i for i, d in enumerate(DTYPES)}


def dtype_code(dtype: Any) -> int:
    """``dtype``'s code in a signature (``Field.DTYPE``)."""
    dtype = np.dtype(dtype)
    return _DTYPE_CODES.get(dtype, 1000 + dtype.num)


def dtype_name(code: int) -> str:
    """The name of the dtype whose signature code is ``code``."""
    return DTYPES[code].name if code < len(DTYPES) else f"dtype#{code - 1000}"


def as_int64(handle: int) -> int:
    """An MPI handle from mpi4py (MPICH's are ints that mpi4py may give
    sign-extended as unsigned) as the signed 64-bit integer kernels take."""
    return handle - (1 << 64) if handle >= 1 << 63 else handle


def layout(shapes: Sequence[Shape], dtypes: Sequence[Any], tag: str = "") -> tuple[int, int, int]:
    """(first dtype's code, elements, layout hash): the static part of a
    signature (``signature``'s ``dtype`` given as a sequence), for kernels that
    build it without Python."""
    return _layout(tuple(tuple(int(d) for d in shape) for shape in shapes), tuple(dtypes), tag)


def signature(
    seq: int,
    kind: int,
    dtype: Any,
    shapes: Sequence[Shape],
    rows: int = 0,
    nbytes: int = 0,
    tag: str = "",
    solo: int = 0,
    token_step: int = 0,
    notice: int = 0,
) -> np.ndarray:
    """The fixed-size description of a collective that every rank compares
    (``Field``'s fields, in order).

    ``kind``: the collective's kind code (``kinds.Kind.code``).
    ``shapes``: the shapes that must agree (of each tensor packed into an
    allreduce; of a broadcast tensor; of a row of each all_gathered tensor).
    ``dtype``: one dtype, or one per shape (all_gather of several tensors).
    ``tag``: text that must agree too (which save, of which path).
    ``solo``: the code of the partial meeting this rank is in without the
    other ranks (0: none).
    ``token_step``: how far the ordering token moved since the previous collective.
    ``notice``: this rank's preemption notice (a signal number; 0: none).
    """
    dtypes = tuple(dtype) if isinstance(dtype, (list, tuple)) else (dtype,)
    code, count, layout = _layout(tuple(tuple(shape) for shape in shapes), dtypes, tag)
    return np.array(
        [seq, kind, code, count, len(shapes), layout, solo, token_step, rows, nbytes, notice],
        np.int64,
    )


@functools.lru_cache(maxsize=4096)
def _layout(
    shapes: tuple[tuple[int, ...], ...], dtypes: tuple[Any, ...], tag: str
) -> tuple[int, int, int]:
    """(first dtype's code, elements, hash of shapes, dtypes and tag): the same few
    collectives recur every step, so each is worked out once."""
    ints = [tuple(int(d) for d in shape) for shape in shapes]
    codes = [dtype_code(d) for d in dtypes]
    count = sum(math.prod(shape) for shape in ints)
    return codes[0], count, zlib.crc32(repr((ints, codes, tag)).encode()) & 0x7FFFFFFF


def fingerprint() -> str:
    """Every constant of the protocol as ``name=value;`` items: what a
    compiled library reports of itself, to be compared at load time."""
    items = [f"field.{f.name.lower()}={f.value}" for f in Field]
    items += [f"signature.fields={len(Field)}", f"signature.bytes={SIGNATURE_BYTES}"]
    items += [f"must_agree.first={MUST_AGREE.start}", f"must_agree.last={MUST_AGREE.stop - 1}"]
    items += [f"state.{s.name.lower()}={s.value}" for s in State]
    items += [f"state.fields={len(State)}"]
    items += [f"event.{e.name.lower()}={e.value}" for e in Event]
    items += [f"op.{o.name.lower()}={o.value}" for o in Op]
    items += [f"fnv.offset={FNV_OFFSET}", f"fnv.prime={FNV_PRIME}"]
    items += [f"align.pack={PACK_ALIGN}", f"align.piece={PIECE_ALIGN}"]
    items += [f"announce.tag={ANNOUNCE_TAG}"]
    return "".join(f"{item};" for item in items)


def header() -> str:
    """The C++ header the kernels are built with: these constants, and a
    ``Describe()`` that reports them as compiled (``fingerprint()``'s format)."""
    camel = _camel
    fields = ", ".join(f"k{camel(f.name)} = {f.value}" for f in Field)
    state = "\n".join(f"  int64_t {s.name.lower()};" for s in State)
    events = ", ".join(f"k{camel(e.name)} = {e.value}" for e in Event)
    ops = ", ".join(f"k{camel(o.name)} = {o.value}" for o in Op)
    report = [f'"field.{f.name.lower()}=", k{camel(f.name)}' for f in Field]
    report += ['"signature.fields=", kFields', '"signature.bytes=", kSignatureBytes']
    report += ['"must_agree.first=", kMustAgreeFirst', '"must_agree.last=", kMustAgreeLast']
    report += [f'"state.{s.name.lower()}=", offsetof(State, {s.name.lower()}) / 8' for s in State]
    report += ['"state.fields=", sizeof(State) / 8']
    report += [f'"event.{e.name.lower()}=", k{camel(e.name)}' for e in Event]
    report += [f'"op.{o.name.lower()}=", k{camel(o.name)}' for o in Op]
    report += ['"fnv.offset=", kFnvOffset', '"fnv.prime=", kFnvPrime']
    report += ['"align.pack=", kPackAlign', '"align.piece=", kPieceAlign']
    report += ['"announce.tag=", kAnnounceTag']
    lines = "\n".join(f"  Put(&out, {item});" for item in report)
    return f"""// Generated from mpi_strategy/_src/core/protocol.py when the kernels are built.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace protocol {{

enum Field : int {{ {fields}, kFields = {len(Field)} }};
constexpr int kMustAgreeFirst = {MUST_AGREE.start}, kMustAgreeLast = {MUST_AGREE.stop - 1};
constexpr int kSignatureBytes = {SIGNATURE_BYTES};

struct State {{
{state}
}};

enum Event : int64_t {{ {events} }};
enum Op : int64_t {{ {ops} }};

constexpr uint64_t kFnvOffset = {FNV_OFFSET}ull, kFnvPrime = {FNV_PRIME}ull;
constexpr int64_t kPackAlign = {PACK_ALIGN}, kPieceAlign = {PIECE_ALIGN};
constexpr int kAnnounceTag = {ANNOUNCE_TAG};

template <typename T>
void Put(std::string* out, const char* name, T value) {{
  *out += name + std::to_string(value) + ";";
}}

// The constants as compiled (protocol.fingerprint()'s format).
inline std::string Describe() {{
  std::string out;
{lines}
  return out;
}}

}}  // namespace protocol
"""


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))
