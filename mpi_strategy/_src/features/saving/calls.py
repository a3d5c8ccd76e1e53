"""The TensorFlow and Keras calls that write files become write points.

``write_point_wrapper`` makes each function or method listed in
``_tf_internal.WRITE_CALLS`` and in the ``write_calls`` of
``_keras_internal.SITES`` (``effects.py`` installs the wrappers) a write point
when it is this library's work (``write_point.applies``): a call made on every
rank writes once per filesystem and returns on every rank once the files are
complete. A call made on some ranks only writes there, as before; any other
call runs unchanged.
On a rank that does not write, the call instead:

* ``memory``: runs against an in-memory path (``ram://``), so that whatever
  the save reads through a collective (metrics) is read on every rank;
* ``h5_memory``: runs against an in-memory HDF5 file (h5py writes outside
  TensorFlow's filesystems);
* ``skip``: does nothing (index files, deletions of old checkpoints);
* ``scratch_if_h5``: ``scratch`` for an HDF5 file (h5py opens local files
  only), else ``memory``;
* ``noop_writer``: returns ``tf.summary.create_noop_writer()``;
* ``devnull``: writes to ``os.devnull`` (a log file kept open across calls);
* ``scratch``: runs against a path in a fresh local directory, in memory
  (``/dev/shm``) where it has room, else in the temporary directory, deleted
  right after (writers that open local files only);
* ``same``: runs unchanged (its writes are already write points); the ranks
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
from typing import Any

import tensorflow as tf

from mpi_strategy._src._tf_internal import WriteCall
from mpi_strategy._src.core.logs import logger
from mpi_strategy._src.features.saving import write_point


def synchronous_checkpoint_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """A Checkpoint method (``_tf_internal.ASYNC_CHECKPOINT_CALLS``) that ignores
    the asynchronous-checkpoint option for this library's checkpoints: a write
    point must run in the calling thread, where the ranks meet."""

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

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        path = _attribute(bound, listed.path)
        call = listed
        if call.instead == "scratch_if_h5" and isinstance(path, (str, os.PathLike)):
            call = call._replace(instead="scratch" if _is_h5(bound, path) else "memory")
        if write_point.role() == write_point.IN_MEMORY:  # inside an outer write point
            if _replaced_when_nested(call, path):
                return _instead(function, bound, call, path)
            return function(*args, **kwargs)
        if write_point.role() is not None:  # inside an outer listed call: it decided
            return function(*args, **kwargs)
        written = write_point.NO_OBJECT if listed.of is None else _attribute(bound, listed.of)
        ordered = write_point.applies(path, written)
        if ordered is None:
            with write_point.not_ours():
                return function(*args, **kwargs)
        with write_point.write_point(ordered, path, what), _scope_of_model(bound):
            if write_point.role() == write_point.IN_MEMORY:
                return _instead(function, bound, call, path)
            return function(*args, **kwargs)

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


def _replaced_when_nested(call: WriteCall, path: Any) -> bool:
    """Whether a call inside an in-memory write point must be replaced too: yes,
    unless it already writes where the outer call sent it (memory, scratch)."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    path = os.fspath(path)
    in_memory, in_scratch = path.startswith("ram://"), _in_scratch(path)
    ours = {
        "memory": in_memory,
        "scratch": in_scratch,  # (scratch: opens local files only)
        "devnull": in_memory or in_scratch,
        "same": in_memory or in_scratch,
    }
    return not ours.get(call.instead, False)


def _attribute(bound: inspect.BoundArguments, where: str) -> Any:
    """The argument named ``where``, or for "self.<a>.<b>" that attribute of self."""
    if where.startswith("self."):
        value = bound.arguments["self"]
        for name in where.split(".")[1:]:
            value = getattr(value, name, None)
        return value
    return bound.arguments.get(where)


def _instead(
    function: Callable[..., Any], bound: inspect.BoundArguments, call: WriteCall, path: Any
) -> Any:
    """What a rank that does not write for ``path`` does instead of ``function``."""
    if call.instead == "skip":
        return None
    if call.instead == "noop_writer":
        return tf.summary.create_noop_writer()
    if call.instead == "same":
        return function(*bound.args, **bound.kwargs)
    if call.instead == "h5_memory":
        import h5py

        with h5py.File(io.BytesIO(), "w") as memory_file:
            bound.arguments[call.path] = memory_file
            return function(*bound.args, **bound.kwargs)
    path = os.fspath(path)
    if call.instead == "scratch":
        scratch = tempfile.mkdtemp(prefix=_SCRATCH_PREFIX, dir=_scratch_root())
        target = os.path.join(scratch, os.path.basename(os.path.normpath(path)))
    else:
        target = os.devnull if call.instead == "devnull" else write_point.memory_path(path)
    try:
        if call.attrs:
            return _with_attributes_at(function, bound, call, path, target)
        bound.arguments[call.path] = target
        return _real_path_in(function(*bound.args, **bound.kwargs), target, path)
    finally:
        if call.instead == "scratch":
            shutil.rmtree(scratch, ignore_errors=True)
        elif target != os.devnull:
            write_point.remove_memory_path(target)


def _in_scratch(path: Any) -> bool:
    return os.path.basename(os.path.dirname(os.fspath(path))).startswith(_SCRATCH_PREFIX)


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
