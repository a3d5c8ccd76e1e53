"""Runs a Horovod program unchanged on mpi_strategy.horovod.

    mpiexec -n 4 python -m mpi_strategy.horovod train.py [args]
    mpiexec -n 4 python -m mpi_strategy.horovod -m pytest test_tensorflow.py

``import horovod.tensorflow as hvd`` (and ``.keras``, ``.elastic``, ...) in
the program then imports this package's modules. If the real ``horovod`` is
installed, this refuses (it would be ambiguous which one the program means)
unless ``--replace-horovod`` is given.
"""

from __future__ import annotations

import runpy
import sys

from mpi_strategy._src.horovod import aliases

USAGE = "usage: python -m mpi_strategy.horovod [--replace-horovod] (SCRIPT | -m MODULE) [ARGS...]"


def main(argv: list[str]) -> int:
    """Runs the script or module named in ``argv`` with ``horovod`` aliased."""
    replace = "--replace-horovod" in argv[:1]
    argv = argv[1:] if replace else argv
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        print(USAGE, file=sys.stderr)
        return 2
    installed = aliases.real_horovod()
    if installed and not replace:
        print(
            f"mpi_strategy.horovod: the real horovod is installed ({installed}). Run the "
            "program with `python` to use it, or pass --replace-horovod to run it on "
            "mpi_strategy.horovod instead.",
            file=sys.stderr,
        )
        return 2
    aliases.install()
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, _directory(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    return 0


def _directory(script: str) -> str:
    import os

    return os.path.dirname(os.path.abspath(script))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
