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

from mpi4py import MPI

DEFAULT_TIMEOUT = float(os.environ.get("MPI_STRATEGY_TEST_TIMEOUT", "300"))


def is_open_mpi():
    return "Open MPI" in MPI.Get_library_version()


def mpiexec_command(n):
    if is_open_mpi():
        return ["mpiexec", "--oversubscribe", "--tag-output", "-n", str(n)]
    return ["mpiexec", "-prepend-rank", "-n", str(n)]


def mpiexec_env():
    """What ``mpiexec_command`` needs in the environment (Open MPI refuses root without it)."""
    if is_open_mpi():
        return {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return {}


def run_mpiexec(n, argv, timeout=DEFAULT_TIMEOUT, env=None, cwd=None):
    """Runs ``argv`` on ``n`` ranks; returns (returncode, combined output)."""
    return run_launcher(mpiexec_command(n) + list(argv), timeout, dict(env or {}, **mpiexec_env()),
                        cwd)


def run_launcher(cmd, timeout=DEFAULT_TIMEOUT, env=None, cwd=None):
    """Runs the launcher command line ``cmd``; returns (returncode, combined output)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=full_env, cwd=cwd, start_new_session=True, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(
            f"TIMEOUT: `{' '.join(cmd)}` did not finish within {timeout:.0f} s "
            f"(a deadlock or a rank stuck in a collective). Output:\n{out[-20000:]}")
    return proc.returncode, out


def python_argv(*args):
    return [sys.executable, *args]
