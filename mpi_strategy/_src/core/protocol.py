"""The agreement's wire protocol, written once for both engines.

Every collective starts with the agreement (``agreement.py``): each rank
sends a fixed-size *record*, an int64 *signature* (``Field``) followed by
carried data, and the ranks compare what must agree. The Python engine
(``collectives.py``) and the compiled kernels (``native/kernels/``) must
build, send and read these bytes alike, so that a rank on one meets a rank on
the other; and the kernels and Python must agree on the ops' attributes
(``ATTRS``), the callback's signature and the library's functions (``CALLBACK``,
``EXPORTS``), the
data an event hands Python (``TRACE``, ``BAD_SPLITS``) and the announcements'
offsets (``announced``). This module is the one place those rules are written: the C++
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
from typing import Any, NamedTuple

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


class Attr(NamedTuple):
    """An int64 attribute of every kernel's op: what tracing fixes (``Site``)."""

    name: str
    default: int | None = None  # None: every call passes it (else: the ops
    # whose kernels read it pass it, core/collective_ops NativeOp.reads)

    def spec(self) -> str:
        """As TensorFlow's op definition declares it."""
        return f"{self.name}: int" + ("" if self.default is None else f" = {self.default}")


ATTRS = (
    Attr("engine"),  # the communicator (NativeComm.id)
    Attr("site"),  # the shapes the agreement compares (their index)
    Attr("kind"),  # the signature's static fields (``layout``)
    Attr("dtype_code"),
    Attr("count"),
    Attr("tensors"),
    Attr("layout"),
    Attr("root", 0),
    Attr("op", 0),  # a reduction's ``Op``
    Attr("mpi_dtype", 0),  # MPI handles of the reduction
    Attr("mpi_op", 0),
    Attr("contiguous", 0),  # 1: tensors packed back to back
    Attr("timed", 0),  # 1: the agreement's exchange gives up after timeout_bits
    Attr("timeout_bits", 0),  # the timeout's seconds, the bits of a double
    Attr("trace", 0),  # a timeline records: the op name's number, else 0
)


# The C types of the callback's and the library's functions' arguments, and
# of the events' data.
CTYPES = {
    "void": "void",
    "int32": "int",
    "int64": "int64_t",
    "ssize": "intptr_t",
    "double": "double",
    "pointer": "void*",
    "text": "char*",
    "const_text": "const char*",
    "words": "int64_t*",
    "resolve": "protocol::Resolve",
}
Signature = tuple[tuple[str, str], ...]  # (name, CTYPES key) of each argument
# Python's answer on a kernel's error path (native/engine.py ``_resolve``),
# returning int32: 0 to go on, else a TF_Code with the message written.
CALLBACK: Signature = (
    ("engine", "int64"),
    ("event", "int64"),  # an Event
    ("site", "int64"),
    ("received", "pointer"),  # the event's data
    ("value", "int64"),
    ("message", "text"),
    ("capacity", "int64"),
)


class Function(NamedTuple):
    """A C function of the library that Python calls (ctypes)."""

    returns: str  # a CTYPES key
    args: Signature


EXPORTS = {
    # Once, before any kernel runs: where MPI is, the handles that differ
    # between MPI libraries, the way back to Python. NULL, or what is missing.
    "mpi_strategy_native_init": Function(
        "const_text",
        (
            ("mpi4py_library", "const_text"),
            ("in_place", "ssize"),
            ("byte", "ssize"),
            ("int64", "ssize"),
            ("max", "ssize"),
            ("resolve", "resolve"),
        ),
    ),
    # A communicator's shared block (kernels/shared_state.cc).
    "mpi_strategy_state_open": Function("words", (("engine", "int64"), ("words", "int64"))),
    "mpi_strategy_state_close": Function("void", (("engine", "int64"),)),
    "mpi_strategy_states_open": Function("int64", ()),
}


class Layout(NamedTuple):
    """A C struct of 8-byte words (``CTYPES`` "int64" or "double") that a kernel
    hands Python with an event (``received``)."""

    struct: str  # its name in C++
    fields: Signature


# Event.TRACE: a kernel's run for the timeline (value: the op name's number).
TRACE = Layout(
    "TraceReport",
    (
        ("started", "double"),  # time.perf_counter's clock
        ("agreed", "double"),
        ("ended", "double"),
        ("bytes", "int64"),  # given to it
        ("tensors", "int64"),  # as the Python engine counts them
        ("seq", "int64"),  # the collective's number
    ),
)
# Event.BAD_SPLITS (value: the words in all): this head, then this rank's k
# splits, then every rank's splits and whether they fit (size rows of size + 1).
BAD_SPLITS = Layout("BadSplitsHead", (("rows", "int64"), ("k", "int64")))


class Announced(NamedTuple):
    """Where the announcements' words are (``timeouts.Announcements.shared``,
    after ``State`` in a communicator's block), in int64 words from its start."""

    last_seen: int  # the last collective each rank entered (size of them)
    number: int  # the kernels' outgoing number
    requests: int  # the kernels' pending send requests (size of them; 0: none)
    words: int  # in all


# Each of Announced's offsets as (a, b): a * size + b on a communicator of size ranks.
ANNOUNCED = {"last_seen": (0, 0), "number": (1, 0), "requests": (1, 1), "words": (2, 1)}
ANNOUNCED_SAMPLE = 3  # the size at which the loader compares the compiled offsets


def announced(size: int) -> Announced:
    """The announcements' offsets on a communicator of ``size`` ranks."""
    return Announced(**{name: a * size + b for name, (a, b) in ANNOUNCED.items()})


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
    items += [f"attr.{a.name}={'required' if a.default is None else a.default}" for a in ATTRS]
    items += [f"attrs={len(ATTRS)}"]
    items += [f"callback={_signature('int32', CALLBACK)}"]
    items += [f"export.{name}={_signature(f.returns, f.args)}" for name, f in EXPORTS.items()]
    for prefix, layout in (("trace", TRACE), ("bad_splits", BAD_SPLITS)):
        items += [f"{prefix}.{name}={i}:{t}" for i, (name, t) in enumerate(layout.fields)]
        items += [f"{prefix}.words={len(layout.fields)}"]
    sample = announced(ANNOUNCED_SAMPLE)
    items += [f"announce.{name}({ANNOUNCED_SAMPLE})={getattr(sample, name)}" for name in ANNOUNCED]
    return "".join(f"{item};" for item in items)


def _signature(returns: str, args: Signature) -> str:
    """A function's types as the compiled library reports them (``Signature``
    in the header): intptr_t is int64 (64-bit platforms only), a pointer is a
    pointer, but for text and the callback."""
    abi = {"ssize": "int64", "words": "pointer"}
    return f"{abi.get(returns, returns)}({','.join(abi.get(t, t) for _, t in args)})"


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
    for prefix, layout in (("trace", TRACE), ("bad_splits", BAD_SPLITS)):
        report += [
            f'"{prefix}.{name}=", Word<decltype({layout.struct}::{name})>('
            f"offsetof({layout.struct}, {name}))"
            for name, _ in layout.fields
        ]
        report += [f'"{prefix}.words=", sizeof({layout.struct}) / 8']
    report += [
        f'"announce.{name}({ANNOUNCED_SAMPLE})=", AnnouncedAt({ANNOUNCED_SAMPLE}).{name}'
        for name in ANNOUNCED
    ]
    report += ['"callback=", Signature<Resolve>::Of()']
    report += [f'"export.{name}=", Signature<decltype(&::{name})>::Of()' for name in EXPORTS]
    lines = "\n".join(f"  Put(&out, {item});" for item in report)
    return f"""// Generated from mpi_strategy/_src/core/protocol.py when the kernels are built.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

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

{_attrs_cxx()}

// Python's answer on a kernel's error path.
using Resolve = {_function_cxx("int32", CALLBACK, "(*)")};

}}  // namespace protocol

// The library's functions Python calls: a definition of other arguments
// does not compile (a C function declared twice).
extern "C" {{
{_exports_cxx()}
}}

namespace protocol {{

{_layout_cxx(TRACE)}
{_layout_cxx(BAD_SPLITS)}

// The announcements' words after State (offsets in int64 words from their start).
struct Announced {{
  int64_t {", ".join(ANNOUNCED)};
}};
constexpr Announced AnnouncedAt(int64_t size) {{
  return {{{", ".join(f"{a} * size + {b}" for a, b in ANNOUNCED.values())}}};
}}

template <typename T>
void Put(std::string* out, const char* name, T value) {{
  *out += name + std::to_string(value) + ";";
}}
inline void Put(std::string* out, const char* name, const std::string& value) {{
  *out += name + value + ";";
}}

// A type as protocol.CTYPES names it (protocol._signature).
template <typename T>
std::string TypeCode() {{
  if constexpr (std::is_void<T>::value) {{
    return "void";
  }} else if constexpr (std::is_same<T, Resolve>::value) {{
    return "resolve";
  }} else if constexpr (std::is_same<T, const char*>::value) {{
    return "const_text";
  }} else if constexpr (std::is_same<T, char*>::value) {{
    return "text";
  }} else if constexpr (std::is_pointer<T>::value) {{
    return "pointer";
  }} else if constexpr (std::is_floating_point<T>::value) {{
    return "double";
  }} else {{
    return "int" + std::to_string(8 * sizeof(T));
  }}
}}
template <typename F>
struct Signature;
template <typename R, typename... A>
struct Signature<R (*)(A...)> {{
  static std::string Of() {{
    std::string args;
    ((args += (args.empty() ? "" : ",") + TypeCode<A>()), ...);
    return TypeCode<R>() + "(" + args + ")";
  }}
}};
// A field of a layout: its offset in words, and its type.
template <typename T>
std::string Word(size_t offset) {{
  return std::to_string(offset / 8) + ":" + TypeCode<T>();
}}

// "attr.<name>=<default, or required>" for each attribute ops declare.
inline void PutAttrs(std::string* out) {{
  for (const AttrSpec& attr : kAttrs) {{
    const std::string spec = attr.spec;
    const size_t equals = spec.find(" = ");
    Put(out, ("attr." + AttrName(attr) + "=").c_str(),
        equals == std::string::npos ? std::string("required") : spec.substr(equals + 3));
  }}
  Put(out, "attrs=", sizeof(kAttrs) / sizeof(kAttrs[0]));
}}

// The constants as compiled (protocol.fingerprint()'s format).
inline std::string Describe() {{
  std::string out;
{lines}
  PutAttrs(&out);
  return out;
}}

}}  // namespace protocol
"""


def _attrs_cxx() -> str:
    """The attributes: their values (``Attrs``), and how ops declare them
    (``kAttrs``: TensorFlow's spec, and where its value goes)."""
    fields = "\n".join(f"  int64_t {a.name} = {a.default or 0};" for a in ATTRS)
    specs = "\n".join(f'    {{"{a.spec()}", &Attrs::{a.name}}},' for a in ATTRS)
    return f"""struct Attrs {{
{fields}
}};
struct AttrSpec {{
  const char* spec;
  int64_t Attrs::*field;
}};
constexpr AttrSpec kAttrs[] = {{
{specs}
}};
inline std::string AttrName(const AttrSpec& attr) {{
  const std::string spec = attr.spec;
  return spec.substr(0, spec.find(':'));
}}"""


def _function_cxx(returns: str, signature: Signature, name: str) -> str:
    args = ", ".join(f"{CTYPES[t]} {arg}" for arg, t in signature)
    return f"{CTYPES[returns]} {name}({args})"


def _exports_cxx() -> str:
    return "\n".join(f"{_function_cxx(f.returns, f.args, name)};" for name, f in EXPORTS.items())


def _layout_cxx(layout: Layout) -> str:
    fields = "\n".join(f"  {CTYPES[t]} {name};" for name, t in layout.fields)
    return f"struct {layout.struct} {{\n{fields}\n}};"


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))
