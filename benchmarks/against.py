"""Step times of this tree against another commit, measured side by side in one run.

    python -m benchmarks.against fc4a221                   # MLP, Higgs-sized DNN, wide & deep
    python -m benchmarks.against HEAD~3 --models mlp --rounds 5

For a change that must not slow training down (a refactoring, another
engine): checks the commit out in a temporary git worktree, then runs
``benchmarks.train_step <model> mpi`` on 2 ranks under mpiexec alternately
from that worktree and from this tree (A B A B ..., so that the drift of a
busy machine hits both alike), and prints each side's median of the rounds'
median step times, their ratio, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks import load_average, slowest_rank_ms
from testing.launch import mpiexec_command, mpiexec_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODELS = "mlp,higgs_small,widedeep"


def _median_ms(tree: str, models: str, steps: int, ranks: int) -> dict[str, float]:
    """{model: ms per step} of one launch of ``tree``'s benchmarks and package."""
    env = dict(os.environ, **mpiexec_env(ranks), PYTHONPATH=tree, TF_CPP_MIN_LOG_LEVEL="3")
    argv = [
        *mpiexec_command(ranks),
        sys.executable,
        "-m",
        "benchmarks.train_step",
        models,
        "mpi",
        "--steps",
        str(steps),
        "--warmup",
        str(max(5, steps // 6)),
    ]
    return slowest_rank_ms(argv, tree, env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("commit", help="the commit to compare with (any git revision)")
    parser.add_argument("--models", default=DEFAULT_MODELS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mpi_strategy-against-") as scratch:
        other = os.path.join(scratch, "tree")
        subprocess.run(
            ["git", "worktree", "add", "--detach", other, args.commit],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        try:
            results = _compare(other, args)
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", other],
                cwd=REPO,
                check=False,
                capture_output=True,
            )
    print(json.dumps(results))
    return 0


def _compare(other: str, args: argparse.Namespace) -> dict[str, object]:
    load_before = load_average()
    rounds: dict[str, list[dict[str, float]]] = {"that": [], "this": []}
    for _ in range(args.rounds):
        rounds["that"].append(_median_ms(other, args.models, args.steps, args.ranks))
        rounds["this"].append(_median_ms(REPO, args.models, args.steps, args.ranks))
    rows = {}
    for model in args.models.split(","):
        that = statistics.median(r[model] for r in rounds["that"])
        this = statistics.median(r[model] for r in rounds["this"])
        rows[model] = {
            "that_ms": round(that, 3),
            "this_ms": round(this, 3),
            "this_over_that": round(this / that, 3),
        }
        print(
            f"{model:12s} {args.commit}: {that:8.3f} ms   this tree: {this:8.3f} ms   "
            f"ratio {this / that:.3f}",
            file=sys.stderr,
        )
    return {
        "commit": args.commit,
        "ranks": args.ranks,
        "rounds": rounds,
        "models": rows,
        "load_average_before": load_before,
        "load_average_after": load_average(),
    }


if __name__ == "__main__":
    sys.exit(main())
