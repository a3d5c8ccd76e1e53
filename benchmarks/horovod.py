"""Horovod's API on mpi_strategy against MPIStrategy, and against Horovod itself.

    python -m benchmarks.horovod                                  # MLP and Higgs-sized DNN
    python -m benchmarks.horovod --horovod-venv /tmp/hvd-venv     # and the real Horovod 0.28.1
    python -m benchmarks.horovod --models mlp --rounds 5

One training step (benchmarks.train_step) on 2 ranks, launched alternately
(A B C ..., so that the drift of a busy machine hits all alike) as:
``mpi`` (MPIStrategy, on the default engine: the native kernels where they
build), ``mpi-python-engine`` (MPI_STRATEGY_KERNELS=python), ``hvd-face``
(the same step written for Horovod, run
by ``python -m mpi_strategy.horovod``: DistributedGradientTape on the same
collective core) and, given a venv with Horovod built (its own Python and
MPI: see docs/benchmarks.md for the recipe), ``horovod`` with its default
1 ms cycle and ``horovod-cycle0.1`` (HOROVOD_CYCLE_TIME=0.1). Prints each
variant's median of the rounds' (slowest-rank median) step times, each one's
ratio to MPIStrategy, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from benchmarks import load_average, slowest_rank_ms
from testing.launch import mpiexec_command, mpiexec_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def variants(venv: str | None, ranks: int) -> dict[str, tuple[list[str], dict[str, str]]]:
    """{name: (argv before the train_step arguments, extra environment)}."""
    ours = [*mpiexec_command(ranks), sys.executable]
    found = {
        "mpi": ([*ours, "-m", "benchmarks.train_step"], {}),
        "mpi-python-engine": (
            [*ours, "-m", "benchmarks.train_step"],
            {"MPI_STRATEGY_KERNELS": "python"},
        ),
        "hvd-face": (
            [*ours, "-m", "mpi_strategy.horovod", "-m", "benchmarks.train_step"],
            {},
        ),
    }
    if venv:
        theirs = [os.path.join(venv, "bin", "mpiexec"), "-n", str(ranks)]
        python = os.path.join(venv, "bin", "python")
        found["horovod"] = ([*theirs, python, "-m", "benchmarks.train_step"], {})
        found["horovod-cycle0.1"] = (
            [*theirs, python, "-m", "benchmarks.train_step"],
            {"HOROVOD_CYCLE_TIME": "0.1"},
        )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,higgs_small")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--horovod-venv", help="a venv with horovod 0.28.1 built (and its MPI)")
    args = parser.parse_args(argv)
    load_before = load_average()
    env = dict(os.environ, **mpiexec_env(args.ranks), PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3")
    rounds: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for name, (prefix, extra) in variants(args.horovod_venv, args.ranks).items():
            mode = "mpi" if name.startswith("mpi") else "horovod"
            step_args = [args.models, mode, "--steps", str(args.steps)]
            step_args += ["--warmup", str(max(5, args.steps // 6))]
            ms = slowest_rank_ms([*prefix, *step_args], REPO, dict(env, **extra))
            rounds.setdefault(name, []).append(ms)
    table = {}
    for model in args.models.split(","):
        base = statistics.median(r[model] for r in rounds["mpi"])
        table[model] = {}
        for name, measured in rounds.items():
            ms = statistics.median(r[model] for r in measured)
            table[model][name] = {"ms": round(ms, 3), "over_mpi": round(ms / base, 3)}
            print(f"{model:12s} {name:18s} {ms:8.3f} ms  x{ms / base:.3f}", file=sys.stderr)
    result = {
        "ranks": args.ranks,
        "rounds": rounds,
        "models": table,
        "load_average_before": load_before,
        "load_average_after": load_average(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
