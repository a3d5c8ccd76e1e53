"""Compiling the native kernels: once per TensorFlow build and compiler, into a cache.

The sources (``kernels/``) include only TensorFlow's C API headers, which
ship in every TensorFlow wheel, and the wire protocol's header, generated
here from ``core/protocol.py``; it links no MPI. The library goes to
``$MPI_STRATEGY_CACHE_DIR`` (default ``~/.cache/mpi_strategy``), named by a
hash of the source, the TensorFlow version, its compile and link flags and
the machine: a new TensorFlow, a changed source or protocol builds anew. The ranks of
a node build it once, under a file lock; the others wait and load it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import tensorflow as tf

from mpi_strategy._src.core import protocol

SOURCES = sorted(Path(__file__).with_name("kernels").glob("*.cc"))
HEADERS = sorted(Path(__file__).with_name("kernels").glob("*.h"))
HEADER = "mpi_strategy_protocol.h"  # what the sources include: protocol.header()


class BuildError(RuntimeError):
    """The kernels could not be built here (the message says why)."""


def cache_dir() -> Path:
    """Where compiled kernels are kept."""
    if os.environ.get("MPI_STRATEGY_CACHE_DIR"):
        return Path(os.environ["MPI_STRATEGY_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mpi_strategy"


def compiler() -> str:
    """The C++ compiler: ``$CXX``, else ``c++``."""
    return os.environ.get("CXX") or "c++"


def command(output: Path, include: Path) -> list[str]:
    """The compiler's command line that builds the kernels into ``output``,
    with the protocol's header in the folder ``include``."""
    return [
        compiler(),
        "-O2",
        "-shared",
        "-fPIC",
        "-fwrapv",  # integer sums wrap around, as numpy's do
        "-fno-strict-aliasing",
        *tf.sysconfig.get_compile_flags(),
        f"-I{include}",
        *map(str, SOURCES),
        "-o",
        str(output),
        *tf.sysconfig.get_link_flags(),
        "-ldl",
    ]


def library() -> Path:
    """The compiled kernels for this TensorFlow, built on first use.

    Raises ``BuildError`` saying why when they cannot be built here.
    """
    # Not the compiler: through TF's C API, any C++ compiler's build serves
    # (one built on a login node runs where no compiler is installed).
    flags = (tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags())
    header = protocol.header()
    key = hashlib.sha256(
        b"".join(path.read_bytes() for path in [*SOURCES, *HEADERS])
        + header.encode()
        + repr((tf.__version__, flags, platform.machine())).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"kernels-tf{tf.__version__}-{key}.so"
    if target.exists():
        return target
    if shutil.which(compiler()) is None:
        raise BuildError(f"no C++ compiler {compiler()!r} on PATH (set CXX to choose one)")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not target.exists():
                compile_into(target, header)
    except OSError as error:
        raise BuildError(f"cannot write the kernels to {target.parent}: {error}") from error
    return target


def compile_into(target: Path, header: str) -> None:
    """Compiles the kernels into ``target`` with ``header`` as the protocol's header."""
    partial = target.with_name(f"{target.name}.{os.getpid()}.part")
    with tempfile.TemporaryDirectory(dir=target.parent) as include:
        Path(include, HEADER).write_text(header)
        result = subprocess.run(
            command(partial, Path(include)), capture_output=True, text=True, check=False
        )
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        last = "\n".join(result.stderr.strip().splitlines()[-5:])
        raise BuildError(f"{compiler()} failed (exit {result.returncode}): {last}")
    os.replace(partial, target)  # atomic: a reader sees no half-written library
