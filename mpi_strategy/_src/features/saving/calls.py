"""The TensorFlow and Keras calls that write files become write points.

``write_point_wrapper`` makes each function or method listed in
``_tf_internal.WRITE_CALLS`` and in the ``write_calls`` of
``_keras_internal.SITES`` (``effects.py`` installs the wrappers) a write point
when it is this library's work (``write_point.point_for``): a call made on
every rank writes once per filesystem and returns on every rank once the files
are complete. A call made on some ranks only writes there, as before; any other
call runs unchanged.
On a rank that does not write, the call instead does what its ``Instead``
names (one handler each, ``_HANDLERS``):

* ``MEMORY``: runs against an in-memory path (``ram://``), so that whatever
  the save reads through a collective (metrics) is read on every rank;
* ``H5_MEMORY``: runs against an in-memory HDF5 file (h5py writes outside
  TensorFlow's filesystems);
* ``SKIP``: does nothing (index files, deletions of old checkpoints);
* ``SCRATCH_IF_H5``: ``SCRATCH`` for an HDF5 file (h5py opens local files
  only), else ``MEMORY``;
* ``NOOP_WRITER``: returns a summary writer that writes nothing, whose
  flushes return once the writing rank's are done (``summaries.py``, which
  also counts the writing rank's flushes);
* ``DEVNULL``: writes to ``os.devnull`` (a log file kept open across calls);
* ``SCRATCH``: runs against a path in a fresh local directory, in memory
  (``/dev/shm``) where it has room, else in the temporary directory, deleted
  right after (writers that open local files only);
* ``SAME``: runs unchanged (its writes are already write points); the ranks
  only meet before and after, so that the files are complete when it returns.

Functions name the argument holding the path; methods name it ``self.<attr>``
and list the attributes holding paths under it, which are pointed elsewhere
for the call.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import io
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import tensorflow as tf

from mpi_strategy._src._tf_internal import Instead, WriteCall
from mpi_strategy._src.core.errors import MPIStrategyError
from mpi_strategy._src.core.logs import logger
from mpi_strategy._src.features.saving import summaries, write_point


def synchronous_checkpoint_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """A Checkpoint method (``_tf_internal.ASYNC_CHECKPOINT_CALLS``) that ignores
    the asynchronous-checkpoint option for this library's checkpoints: a write
    point must run in the calling thread, where the ranks meet (or it holds
    the directory's lock)."""

    @functools.wraps(original)
    def synchronous(self: Any, file_prefix: Any, options: Any = None) -> Any:
        if (
            options is not None
            and options.experimental_enable_async_checkpoint
            and write_point.ordered_comm_for(self) is not None
        ):
            options = copy.copy(options)
            options.experimental_enable_async_checkpoint = False
            logger.warning(
                "mpi_strategy: asynchronous checkpoints are written "
                "synchronously under MPIStrategy (every rank meets in the save)."
            )
        return original(self, file_prefix, options=options)

    return synchronous


def write_point_wrapper(function: Callable[..., Any], listed: WriteCall) -> Callable[..., Any]:
    """``function`` (listed as ``listed``) as a write point (see the module)."""
    signature = inspect.signature(function)
    what = f"{listed.owner.replace(':', '.')}.{listed.name}"
    handler = handler_for(listed)

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        path = _attribute(bound, listed.path)
        if write_point.role() == write_point.IN_MEMORY:  # inside an outer write point
            if _is_path(path) and not handler.kept_when_nested(bound, os.fspath(path)):
                return handler.instead(function, bound, listed, path)
            return function(*args, **kwargs)
        if write_point.role() is not None:  # inside an outer listed call: it decided
            return function(*args, **kwargs)
        written = write_point.NO_OBJECT if listed.of is None else _attribute(bound, listed.of)
        point = write_point.point_for(path, written, what)
        if point is None:
            with write_point.not_ours():
                return function(*args, **kwargs)
        with point, _scope_of_model(bound):
            if write_point.role() == write_point.IN_MEMORY:
                return handler.instead(function, bound, listed, path)
            return handler.written(function(*args, **kwargs), path)

    return wrapper


def _scope_of_model(bound: inspect.BoundArguments) -> contextlib.AbstractContextManager[Any]:
    """For a tf_keras model, the scope of its strategy if none is entered: what
    tf_keras creates while saving (the metrics' variables of a model not yet
    trained) must be the strategy's, summed over the ranks, not one rank's.
    Only in a save every rank makes: creating a variable is a collective.
    (Keras 3 creates nothing there; it saves metric values as MirroredStrategy
    does, from the first replica, outside the scope.)"""
    model: Any = bound.arguments.get("model")
    if (
        tf.distribute.has_strategy()
        or write_point.alone()
        or not type(model).__module__.startswith("tf_keras.")
    ):
        return contextlib.nullcontext()
    return model.distribute_strategy.scope()


def _attribute(bound: inspect.BoundArguments, where: str) -> Any:
    """The argument named ``where``, or for "self.<a>.<b>" that attribute of self."""
    if where.startswith("self."):
        value = bound.arguments["self"]
        for name in where.split(".")[1:]:
            value = getattr(value, name, None)
        return value
    return bound.arguments.get(where)


def _is_path(path: Any) -> bool:
    return isinstance(path, (str, os.PathLike))


Call = Callable[..., Any]


class Handler(NamedTuple):
    """How a rank that does not write runs one kind of listed call."""

    # (function, its bound arguments, the listed call, the path) -> its result
    instead: Callable[[Call, inspect.BoundArguments, WriteCall, Any], Any]
    # Whether, inside an outer in-memory write point, a call writing to this
    # path already writes where the outer call sent it (memory, scratch) and
    # runs unchanged.
    kept_when_nested: Callable[[inspect.BoundArguments, str], bool]
    # (result, path) -> what the rank that writes returns
    written: Callable[[Any, Any], Any] = lambda result, path: result


def handler_for(listed: WriteCall) -> Handler:
    """The handler of ``listed.instead``; raises for anything not an ``Instead``."""
    if not isinstance(listed.instead, Instead) or listed.instead not in _HANDLERS:
        raise MPIStrategyError(
            f"mpi_strategy: {listed.owner}.{listed.name} is listed with the unknown save "
            f"mode {listed.instead!r}; the modes are {[m.name for m in Instead]}."
        )
    return _HANDLERS[listed.instead]


def _h5_in_memory(function: Call, bound: inspect.BoundArguments, call: WriteCall, path: Any) -> Any:
    import h5py

    with h5py.File(io.BytesIO(), "w") as memory_file:
        bound.arguments[call.path] = memory_file
        return function(*bound.args, **bound.kwargs)


def _in_memory(function: Call, bound: inspect.BoundArguments, call: WriteCall, path: Any) -> Any:
    target = write_point.memory_path(path)
    try:
        return _against(function, bound, call, os.fspath(path), target)
    finally:
        write_point.remove_memory_path(target)


def _in_scratch_dir(
    function: Call, bound: inspect.BoundArguments, call: WriteCall, path: Any
) -> Any:
    scratch = tempfile.mkdtemp(prefix=_SCRATCH_PREFIX, dir=_scratch_root())
    path = os.fspath(path)
    try:
        target = os.path.join(scratch, os.path.basename(os.path.normpath(path)))
        return _against(function, bound, call, path, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _to_devnull(function: Call, bound: inspect.BoundArguments, call: WriteCall, path: Any) -> Any:
    return _against(function, bound, call, os.fspath(path), os.devnull)


def _scratch_if_h5(
    function: Call, bound: inspect.BoundArguments, call: WriteCall, path: Any
) -> Any:
    instead = _in_scratch_dir if _is_h5(bound, path) else _in_memory
    return instead(function, bound, call, path)


def _against(
    function: Call, bound: inspect.BoundArguments, call: WriteCall, path: str, target: str
) -> Any:
    """``function`` writing to ``target`` instead of ``path``."""
    if call.attrs:
        return _with_attributes_at(function, bound, call, path, target)
    bound.arguments[call.path] = target
    return _real_path_in(function(*bound.args, **bound.kwargs), target, path)


def _in_memory_path(bound: inspect.BoundArguments, path: str) -> bool:
    return path.startswith("ram://")


def _in_scratch_path(bound: inspect.BoundArguments, path: str) -> bool:
    return os.path.basename(os.path.dirname(path)).startswith(_SCRATCH_PREFIX)


def _in_memory_or_scratch(bound: inspect.BoundArguments, path: str) -> bool:
    return _in_memory_path(bound, path) or _in_scratch_path(bound, path)


def _kept_if_h5(bound: inspect.BoundArguments, path: str) -> bool:
    kept = _in_scratch_path if _is_h5(bound, path) else _in_memory_path
    return kept(bound, path)


def _never(bound: inspect.BoundArguments, path: str) -> bool:
    return False


_HANDLERS = {
    Instead.MEMORY: Handler(_in_memory, _in_memory_path),
    Instead.H5_MEMORY: Handler(_h5_in_memory, _never),
    Instead.SKIP: Handler(lambda *_: None, _never),
    Instead.SCRATCH_IF_H5: Handler(_scratch_if_h5, _kept_if_h5),
    Instead.NOOP_WRITER: Handler(
        lambda function, bound, call, path: summaries.stand_in(path), _never, summaries.track
    ),
    Instead.DEVNULL: Handler(_to_devnull, _in_memory_or_scratch),
    Instead.SCRATCH: Handler(_in_scratch_dir, _in_scratch_path),
    Instead.SAME: Handler(
        lambda function, bound, call, path: function(*bound.args, **bound.kwargs),
        _in_memory_or_scratch,
    ),
}


_SCRATCH_PREFIX = "mpi_strategy-scratch-"
_SHM_NEEDED = 2 << 30  # containers often give /dev/shm 64 MB: fall back to the disk


def _scratch_root() -> str | None:
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None
    roomy = stat.f_bavail * stat.f_frsize >= _SHM_NEEDED
    return "/dev/shm" if roomy and os.access("/dev/shm", os.W_OK) else None


def _is_h5(bound: inspect.BoundArguments, path: Any) -> bool:
    save_format = str(bound.arguments.get("save_format") or "").lower()
    return save_format in ("h5", "hdf5", "keras") or (
        not save_format and os.fspath(path).endswith((".h5", ".hdf5", ".keras"))
    )


def _with_attributes_at(
    function: Callable[..., Any],
    bound: inspect.BoundArguments,
    call: WriteCall,
    path: Any,
    target: str,
) -> Any:
    """Calls a method with its path attributes moved from ``path`` to ``target``."""
    owner = bound.arguments["self"]
    saved = {name: getattr(owner, name) for name in call.attrs}
    for name, value in saved.items():
        if target == os.devnull:
            setattr(owner, name, target)
        else:
            relative = os.path.relpath(os.fspath(value), path) if value != path else ""
            setattr(owner, name, os.path.join(target, relative) if relative else target)
    try:
        return function(*bound.args, **bound.kwargs)
    finally:
        for name, value in saved.items():
            setattr(owner, name, value)


def _real_path_in(result: Any, target: str, path: str) -> Any:
    """``result`` with the in-memory path replaced by the real one (returned paths)."""
    if isinstance(result, str) and result.startswith(target):
        return path + result[len(target) :]
    if tf.is_tensor(result) and result.dtype == tf.string and result.shape.rank == 0:
        text = result.numpy().decode()
        if text.startswith(target):
            return tf.constant(path + text[len(target) :])
    return result


@contextlib.contextmanager
def only_chief_writes(path: str, comm: Any = None) -> Iterator[str]:
    """Deprecated: yields ``path``. A save made on every rank now writes once
    per filesystem by itself (docs/checkpointing.md)."""
    del comm
    warnings.warn(
        "mpi_strategy.only_chief_writes is no longer needed: call the save on "
        "every rank with the real path; it is written once.",
        DeprecationWarning,
        stacklevel=3,
    )
    yield path
