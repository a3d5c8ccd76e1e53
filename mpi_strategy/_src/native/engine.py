"""The native engine: the collectives as compiled TensorFlow kernels (``NativeComm``).

``MPI_STRATEGY_KERNELS`` chooses: ``native`` (build them or raise), ``python``
(the numpy engine, ``core/collectives.py``), or unset / ``auto``: native when
they build here, else Python, with one line on rank 0 saying why. The two
engines send the same bytes in the same MPI calls and compute the same
results bit for bit, so ranks on different engines still meet correctly.

A kernel runs without Python: the static part of its agreement record is an
attribute fixed when tracing, the dynamic part (collective number, ordering
token, the partial meeting this rank is in) lives in the agreement's
``state``, in memory the library owns (``kernels/shared_state.cc``), which the
kernel finds by its communicator's id (an attribute: never an address, so a
graph that outlives its communicator, or comes from another process, finds
it gone). Python runs only on the error path (``_resolve``), where it writes
the messages and chooses the error classes of the Python engine.
"""

from __future__ import annotations

import ctypes
import inspect
import itertools
import os
import re
import secrets
import sys
import weakref
from collections.abc import Sequence, Set
from dataclasses import dataclass, field
from typing import Any

import mpi4py.MPI
import numpy as np
import tensorflow as tf
from mpi4py import MPI

from mpi_strategy._src.core import collective_ops, kinds, protocol, timeline, ulfm
from mpi_strategy._src.core.collective_ops.base import CollectiveOp, NativeOp, Params
from mpi_strategy._src.core.collectives import ArrayCollectives
from mpi_strategy._src.core.errors import MPIStrategyError
from mpi_strategy._src.core.process import PROCESS
from mpi_strategy._src.core.protocol import Event, Field, Shape, State, as_int64
from mpi_strategy._src.native import build

KERNELS_ENV = "MPI_STRATEGY_KERNELS"
_UNKNOWN = 2  # TF_Code of an exception that is not a tf.errors class


@dataclass
class NativeState:
    """The native engine's part of the process state (``PROCESS.of``)."""

    # Each open communicator by its engine id (``State.ENGINE``), for the error path.
    comms: dict[int, weakref.ref[ArrayCollectives]] = field(default_factory=dict)
    # The shapes a kernel's agreement compares, interned: a kernel holds the index.
    sites: dict[tuple[tuple[int, ...], ...], int] = field(default_factory=dict)
    shapes: list[tuple[tuple[int, ...], ...]] = field(default_factory=list)
    # The op names of kernels traced while a timeline records: a kernel holds
    # its name's index + 1 (``trace``).
    names: list[str] = field(default_factory=list)
    # The Python exception behind each communicator's last kernel error.
    errors: dict[int, BaseException] = field(default_factory=dict)
    # Engine ids: this process's random salt (a graph from another process
    # names no communicator here), then a count.
    ids: itertools.count[int] = field(
        default_factory=lambda: itertools.count((secrets.randbits(30) + 1) << 32)
    )
    # The loaded kernels (None: the Python engine), once ``kernels()`` chose.
    kernels: Kernels | None = None
    chosen: bool = False


def _native() -> NativeState:
    return PROCESS.of(NativeState)


class Unavailable(RuntimeError):
    """The kernels cannot run here (the message says why)."""


class Kernels:
    """The loaded library: its ops and the link to mpi4py's MPI."""

    def __init__(self) -> None:
        if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
            # The Python engine's MPI calls are serialised by Python's lock;
            # the kernels' are not (they run on TensorFlow's threads without it).
            raise Unavailable(
                "MPI was initialized without MPI_THREAD_MULTIPLE, which kernels calling MPI "
                "from TensorFlow's threads need (mpi4py.rc.thread_level)"
            )
        path = build.library()
        # TensorFlow first: it takes the ops registered while it loads the library.
        self.ops = tf.load_op_library(str(path))
        check_ops(self.ops, path)
        library = ctypes.CDLL(str(path))
        check_protocol(library, path)
        for name, function in protocol.EXPORTS.items():  # (as compiled: check_protocol)
            getattr(library, name).argtypes = [_CTYPES[t] for _, t in function.args]
            getattr(library, name).restype = _CTYPES[function.returns]
        given = {
            "mpi4py_library": mpi4py.MPI.__file__.encode(),
            "in_place": int(MPI.IN_PLACE),
            "byte": as_int64(MPI.BYTE.handle),
            "int64": as_int64(MPI.INT64_T.handle),
            "max": as_int64(MPI.MAX.handle),
            "resolve": _resolve_callback,
        }
        init = protocol.EXPORTS["mpi_strategy_native_init"]
        missing = library.mpi_strategy_native_init(*[given[name] for name, _ in init.args])
        if missing is not None:
            raise Unavailable(
                f"the MPI library mpi4py loaded ({mpi4py.MPI.__file__}) lacks "
                f"{missing.decode()} (or was not found)"
            )
        self._library = library

    def open_state(self, engine: int, words: int) -> np.ndarray:
        """A zeroed int64 block of ``words`` for communicator ``engine``, in the
        library's memory: the kernels find it by ``engine`` until the returned
        array and every view of it are gone (then the library frees it once
        no kernel runs on it)."""
        address = self._library.mpi_strategy_state_open(engine, words)
        if not address:
            raise MPIStrategyError(f"mpi_strategy: engine id {engine} is taken")
        memory = (ctypes.c_int64 * words).from_address(address)
        weakref.finalize(memory, self._close, engine).atexit = False
        return np.ctypeslib.as_array(memory)

    def _close(self, engine: int) -> None:
        _native().comms.pop(engine, None)
        self._library.mpi_strategy_state_close(engine)

    def states_open(self) -> int:
        """How many communicators' blocks are open (``open_state``)."""
        return int(self._library.mpi_strategy_states_open())


def check_protocol(library: ctypes.CDLL, path: object) -> None:
    """Raises ``Unavailable`` unless ``library`` was compiled with this
    Python's wire protocol (``core/protocol.py``), naming what differs."""
    reported = b""
    if hasattr(library, "mpi_strategy_protocol"):  # (else built before it was checked)
        library.mpi_strategy_protocol.restype = ctypes.c_char_p
        reported = library.mpi_strategy_protocol() or b""
    theirs = dict(item.split("=", 1) for item in reported.decode().split(";") if item)
    ours = dict(item.split("=", 1) for item in protocol.fingerprint().split(";") if item)
    differ = [
        f"{name}: {theirs.get(name, 'missing')} there, {ours.get(name, 'missing')} here"
        for name in sorted(set(theirs) | set(ours))
        if theirs.get(name) != ours.get(name)
    ]
    if differ:
        raise Unavailable(
            f"the kernels at {path} speak another wire protocol than core/protocol.py "
            f"({'; '.join(differ)}): rebuild them (remove the file)"
        )


def check_ops(ops: Any, path: object) -> None:
    """Raises ``Unavailable`` unless the library's ops (``ops``: its module
    from ``tf.load_op_library``) are those of core/collective_ops, each with
    the inputs its ``NativeOp`` binds and ``protocol.ATTRS``, in order."""
    attrs = [a.name for a in protocol.ATTRS]
    differ = []
    for spec in collective_ops.ALL:
        if spec.native is not None:
            wrapper = getattr(ops, _snake(spec.native.type), None)
            ours = ["token", *spec.native.inputs, *attrs, "name"]
            theirs = None if wrapper is None else list(inspect.signature(wrapper).parameters)
            if theirs != ours:
                differ.append(f"{spec.native.type}: {theirs or 'missing'} there, {ours} here")
    if differ:
        raise Unavailable(
            f"the kernels at {path} register other ops than core/collective_ops declares "
            f"({'; '.join(differ)}): rebuild them (remove the file)"
        )


def check_attrs(native: NativeOp, given: Set[str]) -> None:
    """Raises ``MPIStrategyError`` unless ``given``, the attributes a call of
    ``native`` passes, are ``protocol.ATTRS`` and include every one without a
    default and each one its kernel reads (``native.reads``)."""
    required = {a.name for a in protocol.ATTRS if a.default is None}
    unknown = sorted(given - {a.name for a in protocol.ATTRS})
    missing = sorted((required | set(native.reads)) - given)
    said = [f"{what}: {n}" for what, n in (("not there", unknown), ("left out", missing)) if n]
    if said:
        raise MPIStrategyError(
            f"mpi_strategy: every rank tracing a native {native.type} op: its attributes "
            f"differ from core/protocol.py ATTRS and its NativeOp.reads ({'; '.join(said)})."
        )


def kernels() -> Kernels | None:
    """The native kernels when they are in use (built at the first call), else None."""
    native = _native()
    if not native.chosen:
        native.kernels = _load()  # (an error leaves the choice to the next call)
        native.chosen = True
    return native.kernels


def _load() -> Kernels | None:
    mode = os.environ.get(KERNELS_ENV, "auto").lower() or "auto"
    if mode not in ("native", "python", "auto"):
        raise MPIStrategyError(
            f"mpi_strategy: {KERNELS_ENV}={mode!r}: use 'native', 'python' or 'auto' (the default)."
        )
    if mode == "python":
        return None
    try:
        return Kernels()
    except (Unavailable, build.BuildError, tf.errors.NotFoundError, OSError) as error:
        if mode == "native":
            raise MPIStrategyError(
                f"mpi_strategy: {KERNELS_ENV}=native, but the native kernels are unavailable "
                f"on rank {MPI.COMM_WORLD.Get_rank()}: {error}"
            ) from error
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(
                f"mpi_strategy: using the Python collectives (the native kernels are "
                f"unavailable: {error}); install a C++ compiler for the faster ones, or set "
                f"{KERNELS_ENV}=python to silence this.",
                file=sys.stderr,
            )
        return None


def active() -> str:
    """Which engine runs the collectives: "native" or "python"."""
    return "native" if kernels() is not None else "python"


class NativeComm:
    """The native collectives of one ``ArrayCollectives`` (a communicator)."""

    def __init__(self, kernels: Kernels, collectives: ArrayCollectives) -> None:
        self._ops = kernels.ops
        self.id = next(_native().ids)
        agreement = collectives.agreement
        agreement.move_to(kernels.open_state(self.id, agreement.block.size))
        agreement.state[State.ENGINE] = self.id
        _native().comms[self.id] = weakref.ref(collectives)
        self.size = collectives.size

    @tf.autograph.experimental.do_not_convert
    def run(
        self, spec: CollectiveOp, p: Params, token: tf.Tensor, inputs: Sequence[tf.Tensor]
    ) -> list[tf.Tensor]:
        """[next token, *outputs]: ``spec.numpy`` in one kernel, its op
        ``spec.native`` (``p.shapes``: what the agreement compares, known
        when tracing)."""
        native, shapes = spec.native, p.shapes
        if native is None or shapes is None:
            raise ValueError(f"mpi_strategy: no native kernel runs this {spec.name}")
        dtypes = spec.dtypes([np.dtype(t.dtype.as_numpy_dtype) for t in inputs])
        if native.inputs == ("inputs",):
            bound: dict[str, Any] = {"inputs": list(inputs)}
        else:
            bound = dict(zip(native.inputs, inputs))
        kernel = getattr(self._ops, _snake(native.type))
        site = self._site(spec.kind(p), shapes, dtypes, spec.tag(p), p.timeout, name=spec.op_name)
        own = native.attrs(p, dtypes)
        check_attrs(native, own.keys() | site.keys())
        outputs = kernel(name=spec.op_name, token=token, **bound, **own, **site)
        if native.listed:
            next_token, listed = outputs
            return [next_token, *listed]
        return list(outputs)

    def _site(
        self,
        kind: kinds.Kind,
        shapes: Sequence[Shape],
        dtypes: list[Any],
        tag: str = "",
        timeout: float | None = None,
        *,
        name: str,
    ) -> dict[str, int]:
        """The attributes that fix a kernel's record: what ``signature``
        computes from these arguments, where the shared state is, and the
        timeout (``timed``; its seconds as the bits of a double), and whether
        a timeline records its runs (``trace``: the op ``name``'s number)."""
        code, count, layout = protocol.layout(shapes, [np.dtype(d) for d in dtypes], tag)
        return {
            "engine": self.id,
            "site": _site_id(shapes),
            "kind": kind.code,
            "dtype_code": code,
            "count": count,
            "tensors": len(shapes),
            "layout": layout,
            "timed": int(timeout is not None),
            "timeout_bits": _bits(timeout or 0.0),
            "trace": _name_id(name) if timeline.current() is not None else 0,
        }

    def take_error(self) -> BaseException | None:
        """The Python exception behind this communicator's last kernel error (once)."""
        return _native().errors.pop(self.id, None)


def _snake(op_type: str) -> str:
    """An op type's function in ``tf.load_op_library``'s module (MpiStrategyAllreduce:
    mpi_strategy_allreduce)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", op_type).lower()


def _bits(seconds: float) -> int:
    """The bits of the double ``seconds``, as an int64 (an op attribute)."""
    return int(np.array(seconds, np.float64).view(np.int64))


def _name_id(name: str) -> int:
    names = _native().names
    if name not in names:
        names.append(name)
    return names.index(name) + 1


def _site_id(shapes: Sequence[Shape]) -> int:
    key = tuple(tuple(int(d) for d in shape) for shape in shapes)
    native = _native()
    if key not in native.sites:
        native.sites[key] = len(native.shapes)
        native.shapes.append(key)
    return native.sites[key]


def _resolve(
    engine: int, event: int, site: int, received: int, value: int, message: int, capacity: int
) -> int:
    """A kernel's error path (kernels/agreement.cc ``AskPython``): 0 to go on, else a
    TF_Code, with the message written to ``message``."""
    try:
        held = _native().comms.get(engine)
        collectives = None if held is None else held()
        if collectives is None:
            raise MPIStrategyError(
                "mpi_strategy: a collective ran on a communicator that is gone: freed with "
                "its strategy, or of another process (a graph with MPI collectives runs "
                "only in the process that built it)."
            )
        _answer(collectives, Event(event), site, received, value)
        return 0
    except BaseException as error:  # noqa: BLE001 (every error becomes the kernel's)
        _native().errors[engine] = error
        text = f"{type(error).__name__}: {error}".encode()[: capacity - 1]
        ctypes.memmove(message, text, len(text))
        ctypes.memset(message + len(text), 0, 1)
        code = getattr(error, "error_code", None)
        if event == Event.TIMEOUT:  # (the class a tf.numpy_function gives it)
            return _UNKNOWN
        return code if isinstance(code, int) and code else _UNKNOWN


def _answer(
    collectives: ArrayCollectives, event: Event, site: int, received: int, value: int
) -> None:
    """Python's part of ``_resolve``: returns to go on, else raises the error."""
    if event == Event.BLOCKED:
        collectives.guarded(lambda: None)()
    elif event == Event.MPI_ERROR:
        error = MPI.Exception(value)
        if ulfm.is_process_failure(error):
            raise collectives.ranks_lost(error) from error
        raise error
    elif event == Event.BAD_SPLITS:
        raise _bad_splits(collectives, received, value)
    elif event == Event.TRACE:  # (received: protocol.TRACE; value: the name's number)
        told = _read(protocol.TRACE, received)
        trace = timeline.current()
        if trace is not None:
            name = _native().names[value - 1]
            times = (float(told["started"]), float(told["agreed"]), float(told["ended"]))
            collectives.record(trace, name, times, int(told["bytes"]), int(told["tensors"]))
    elif event == Event.TIMEOUT:  # (received: this rank's record; value: the timeout's bits)
        mine = np.ctypeslib.as_array((ctypes.c_int64 * len(Field)).from_address(received))
        timeout = float(np.array(value, np.int64).view(np.float64))
        raise collectives.agreement.timed_out(mine.copy(), _native().shapes[site], timeout)
    else:
        size, width = collectives.size, record_width(collectives)
        records = np.ctypeslib.as_array(
            (ctypes.c_uint8 * (size * width)).from_address(received)
        ).reshape(size, width)
        collectives.agreement.settle_compiled(records, _native().shapes[site])


def _bad_splits(collectives: ArrayCollectives, address: int, length: int) -> Exception:
    """``ArrayCollectives.bad_splits`` from the kernel's int64 array at ``address``
    (``length`` of them): ``protocol.BAD_SPLITS`` (this rank's rows, k), its k
    splits, then every rank's splits and whether they fit (size rows of size + 1)."""
    head = _read(protocol.BAD_SPLITS, address)
    rows, k = int(head["rows"]), int(head["k"])
    values = np.ctypeslib.as_array((ctypes.c_int64 * length).from_address(address)).copy()
    splits = values[len(protocol.BAD_SPLITS.fields) :]
    matrix = splits[k:].reshape(collectives.size, collectives.size + 1)
    return collectives.bad_splits(matrix, splits[:k].tolist(), rows)


def _read(layout: protocol.Layout, address: int) -> np.void:
    """The struct ``layout`` a kernel wrote at ``address``, by field name."""
    dtype = np.dtype([(name, _NUMPY[t]) for name, t in layout.fields])
    return np.frombuffer(ctypes.string_at(address, dtype.itemsize), dtype)[0]


def record_width(collectives: ArrayCollectives) -> int:
    return int(collectives.agreement.state[State.RECORD_BYTES])


# protocol.CTYPES as ctypes and numpy know them ("text": an address to write to).
_CTYPES: dict[str, Any] = {
    "void": None,
    "int32": ctypes.c_int,
    "int64": ctypes.c_int64,
    "ssize": ctypes.c_ssize_t,
    "pointer": ctypes.c_void_p,
    "text": ctypes.c_void_p,
    "const_text": ctypes.c_char_p,
    "words": ctypes.c_void_p,  # (an address, viewed as int64 by open_state)
}
_NUMPY = {"int64": np.int64, "double": np.float64}
_Resolve = ctypes.CFUNCTYPE(ctypes.c_int, *[_CTYPES[t] for _, t in protocol.CALLBACK])
_CTYPES["resolve"] = _Resolve
_resolve_callback = _Resolve(_resolve)
