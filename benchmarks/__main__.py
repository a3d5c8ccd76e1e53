"""Runs every benchmark side by side and prints a markdown table.

    python -m benchmarks [--ranks 2] [--out benchmarks/results/latest.json]

Ratios are what matter on a noisy 2-core machine: each pair is measured in
the same run. Targets are those of the performance issue (docs/benchmarks.md).
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
COLLECTIVE_SIZES = [4, 4096, 65536, 1048576, 7450000, 67108864]


def _json_lines(cmd, timeout=900):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return [json.loads(line[line.index("{"):]) for line in out.stdout.splitlines() if "{" in line]


def train_steps(ranks):
    python = [sys.executable, "-m", "benchmarks.train_step"]
    results = {
        "no_strategy": _json_lines(python + ["none"])[0],
        "mpi_1_rank": _json_lines(python + ["mpi"])[0],
        f"mpi_{ranks}_ranks": _json_lines(["mpiexec", "-n", str(ranks)] + python + ["mpi"])[0],
    }
    # The ceiling: independent processes, each with its share of the batch, at once.
    procs = [subprocess.Popen(python + ["none", "--batch", str(256 // ranks)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for _ in range(ranks)]
    ceiling = [json.loads(p.communicate(timeout=900)[0].strip().splitlines()[-1]) for p in procs]
    results["ceiling"] = {"ms_per_step": max(c["ms_per_step"] for c in ceiling)}
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "latest.json"))
    args = parser.parse_args()

    collectives = _json_lines(["mpiexec", "-n", str(args.ranks), sys.executable, "-m",
                               "benchmarks.collectives"] + [str(s) for s in COLLECTIVE_SIZES])
    steps = train_steps(args.ranks)
    mpi_n = steps[f"mpi_{args.ranks}_ranks"]["ms_per_step"]
    fused = next(c for c in collectives if c["bytes"] == 7450000)
    small = next(c for c in collectives if c["bytes"] == 4)
    targets = [
        ("fused 7.45 MB reduce / raw Allreduce", fused["ratio_to_raw"], "<= 1.25"),
        ("scalar reduce overhead in tf.function (ms)", small["reduce_overhead_ms"], "<= 0.5"),
        ("MLP step: ceiling / MPIStrategy", steps["ceiling"]["ms_per_step"] / mpi_n, ">= 0.92"),
        ("MLP step: MPIStrategy 1 rank / no strategy",
         steps["mpi_1_rank"]["ms_per_step"] / steps["no_strategy"]["ms_per_step"], "<= 1.05"),
    ]
    report = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "ranks": args.ranks,
              "collectives": collectives, "train_step": steps,
              "targets": [{"what": w, "value": v, "target": t} for w, v, t in targets]}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)

    print("| bytes | raw Allreduce ms | MPIStrategy reduce ms | ratio |")
    print("| ---: | ---: | ---: | ---: |")
    for c in collectives:
        print(f"| {c['bytes']:,} | {c['raw_allreduce_ms']:.3f} | {c['reduce_overhead_ms']:.3f} "
              f"| {c['ratio_to_raw']:.2f} |")
    print("\n| MLP 784-1024-1024-10, global batch 256 | ms/step |\n| --- | ---: |")
    for name, r in steps.items():
        print(f"| {name} | {r['ms_per_step']:.1f} |")
    print("\n| target | measured | goal |\n| --- | ---: | :---: |")
    for what, value, goal in targets:
        print(f"| {what} | {value:.3f} | {goal} |")


if __name__ == "__main__":
    main()
