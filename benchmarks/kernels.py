"""The native kernels against the Python engine, side by side in one run.

    python -m benchmarks --kernels          # through the suite: kernels.json / kernels.md
    python -m benchmarks.kernels            # the same part alone, printed as JSON
    mpiexec -n 2 python -m benchmarks.kernels --overhead   # one launch's per-call costs

Targets (native-kernels issue), each a ratio of launches made in the same run,
the engines alternating round after round (``MPI_STRATEGY_KERNELS``):

- per-collective overhead beyond raw MPI, a scalar reduce inside tf.function:
  <= 10 us. One launch times a tf.function of CHAIN chained scalar all-reduces
  (``OrderedComm.allreduce_sum``, each divided by the size) against the same
  function without them, and the raw MPI of what such a reduce sends (one
  Iallgather of the agreement record, from mpi4py: an upper bound of MPI's
  own cost, since it includes mpi4py's call);
- Higgs-sized DNN, ceiling / MPIStrategy at 2 ranks >= 0.8 (ceiling: two
  independent processes, each with its half of the batch, at the same time);
- wide & deep at 2 ranks / one process at the same global batch <= 1.5;
- MLP and CNN not slower than the Python engine.
"""

import argparse
import json
import statistics
import sys
import time

from benchmarks import cost_model, load_average
from benchmarks.launching import launch_together, python_module, train_variant
from testing.launch import mpiexec_command, mpiexec_env

ENGINES = ("python", "native")
# model: (global batch, timed steps, warm-up steps)
MODELS = {
    "higgs_small": (256, 300, 30),
    "widedeep": (256, 200, 20),
    "mlp": (256, 60, 10),
    "cnn": (128, 20, 5),
}
CHAIN = 50
RANKS = 2
CALIBRATION_BYTES = [8, 4096, 65536, 1 << 20, 1 << 22]


def run(quick=False, progress=print, rounds=3):
    """Every launch of the part, alternating engines; returns the JSON part."""
    rounds = 1 if quick else rounds
    launches = []
    for round_ in range(rounds):
        for engine in ENGINES:
            progress(f"round {round_ + 1}/{rounds}: per-collective overhead / {engine}")
            rows, error = launch_together(
                [
                    (
                        [
                            *mpiexec_command(RANKS),
                            *python_module("benchmarks.kernels", "--overhead"),
                        ],
                        {**mpiexec_env(RANKS), "MPI_STRATEGY_KERNELS": engine},
                    )
                ]
            )
            launches.append({"kind": "overhead", "engine": engine, "rows": rows, "error": error})
        for model, (batch, steps, warmup) in MODELS.items():
            if quick:
                steps, warmup = 6, 2
            variants = [("mpi", engine) for engine in ENGINES]
            variants.append(("ceiling" if model != "widedeep" else "no_strategy", None))
            for variant, engine in variants:
                progress(f"round {round_ + 1}/{rounds}: {model} / {variant} {engine or ''}")
                env = {"MPI_STRATEGY_KERNELS": engine} if engine else {}
                row = train_variant(model, variant, RANKS, batch, steps, warmup, env=env)
                launches.append({"kind": "train", "engine": engine, **row})
    progress("compute time of the paper's workloads at batch 32 (for the cost model)")
    steps = ["--steps", "6", "--warmup", "2"] if quick else ["--steps", "30", "--warmup", "5"]
    argv = python_module("benchmarks.train_step", "lenet3,cnn,higgs", "none", "--batch", "32")
    compute, error = launch_together([([*argv, *steps], {})])
    part = {"rounds": rounds, "launches": launches, "summary": summary(launches)}
    if not error:
        part["cost_model"] = projection(launches, {r["model"]: r for r in compute})
    return part


def projection(launches, compute):
    """The seed paper's table for both engines (benchmarks/cost_model.py), from
    this run's fixed cost per collective, raw Allreduce times and compute."""
    rows = [r for launch in launches if launch["kind"] == "overhead" for r in launch["rows"]]
    calibration = [point for r in rows if r.get("rank") == 0 for point in r["raw_allreduce_s"]]
    fit = cost_model.fit_alpha_beta([n for n, _ in calibration], [t for _, t in calibration], RANKS)
    intra = {"alpha": fit["alpha_s"], "beta": fit["beta_s_per_byte"]}
    fixed = {}
    for engine in ENGINES:
        measured = [r["overhead_us"] for r in rows if r["engine"] == engine]
        fixed[engine] = max(statistics.median(measured), 0.0) * 1e-6
    workloads = {
        name: {
            "params": compute[spec["model"]]["params"],
            "compute_s": compute[spec["model"]]["ms_per_step"] / 1e3,
        }
        for name, spec in cost_model.PAPER_WORKLOADS.items()
    }
    rows = cost_model.engine_projection(workloads, intra, fixed)
    return {
        "calibration": fit,
        "fixed_us": {k: v * 1e6 for k, v in fixed.items()},
        "workloads": workloads,
        "rows": rows,
        "paper": cost_model.engine_comparison(rows),
    }


def summary(launches):
    """Medians over the rounds, and the targets' ratios."""
    out = {"overhead_us": {}, "collective_us": {}, "raw_mpi_us": {}, "ms_per_step": {}}
    for engine in ENGINES:
        rows = [
            r
            for launch in launches
            if launch["kind"] == "overhead" and launch["engine"] == engine
            for r in launch["rows"]
        ]
        for key in ("overhead_us", "collective_us", "raw_mpi_us"):
            values = [r[key] for r in rows if key in r]
            if values:
                out[key][engine] = statistics.median(values)
    for model in MODELS:
        for launch in launches:
            if launch["kind"] != "train" or launch["model"] != model or "ms_per_step" not in launch:
                continue
            name = launch["engine"] or launch["variant"]
            out["ms_per_step"].setdefault(model, {}).setdefault(name, []).append(
                launch["ms_per_step"]
            )
    medians = {
        m: {k: statistics.median(v) for k, v in d.items()} for m, d in out["ms_per_step"].items()
    }
    out["ms_per_step"] = medians
    ratios = {}
    for engine in ENGINES:
        higgs = medians.get("higgs_small", {})
        if engine in higgs and "ceiling" in higgs:
            ratios[f"higgs_ceiling_over_{engine}"] = higgs["ceiling"] / higgs[engine]
        wide = medians.get("widedeep", {})
        if engine in wide and "no_strategy" in wide:
            ratios[f"widedeep_{engine}_over_one_process"] = wide[engine] / wide["no_strategy"]
    for model in ("mlp", "cnn", "higgs_small", "widedeep"):
        row = medians.get(model, {})
        if "native" in row and "python" in row:
            ratios[f"{model}_native_over_python"] = row["native"] / row["python"]
    out["ratios"] = ratios
    return out


def markdown(part):
    s = part["summary"]
    lines = [
        f"Native kernels against the Python engine, 2 ranks, {part['rounds']} round(s), "
        "medians (`python -m benchmarks --kernels`):",
        "",
        "| | Python engine | native kernels | target |",
        "| --- | --- | --- | --- |",
    ]
    o, c, raw = s["overhead_us"], s["collective_us"], s["raw_mpi_us"]
    lines.append(
        f"| scalar all-reduce in tf.function, per call | {c.get('python', 0):.1f} us | "
        f"{c.get('native', 0):.1f} us | |"
    )
    lines.append(
        f"| of which beyond raw MPI ({raw.get('native', 0):.1f} us) | "
        f"{o.get('python', 0):.1f} us | {o.get('native', 0):.1f} us | <= 10 us |"
    )
    for model, row in s["ms_per_step"].items():
        ref = "ceiling" if "ceiling" in row else "no_strategy"
        lines.append(
            f"| {model} step (ms; {ref.replace('_', ' ')}: {row.get(ref, 0):.3f}) | "
            f"{row.get('python', 0):.3f} | {row.get('native', 0):.3f} | |"
        )
    r = s["ratios"]
    lines += [
        "",
        "- Higgs-sized DNN, ceiling / MPIStrategy: "
        f"Python {r.get('higgs_ceiling_over_python', 0):.2f}, "
        f"native {r.get('higgs_ceiling_over_native', 0):.2f} (target >= 0.8).",
        "- Wide & deep, 2 ranks / one process: "
        f"Python {r.get('widedeep_python_over_one_process', 0):.2f}x, "
        f"native {r.get('widedeep_native_over_one_process', 0):.2f}x (target <= 1.5x).",
        "- native / Python step time: "
        + ", ".join(
            f"{m} {r[f'{m}_native_over_python']:.3f}"
            for m in MODELS
            if f"{m}_native_over_python" in r
        )
        + " (target: MLP and CNN <= 1).",
        "",
    ]
    if "cost_model" in part:
        lines += cost_markdown(part["cost_model"])
    return lines


def cost_markdown(model):
    fixed, fit = model["fixed_us"], model["calibration"]
    lines = [
        "Projected speedups (benchmarks/cost_model.py `engine_projection`): each collective "
        f"costs its engine's measured fixed cost (Python {fixed['python']:.1f} us, native "
        f"{fixed['native']:.1f} us beyond MPI) plus the agreement (an allgather of "
        "`record_bytes(p)` per rank; above 1024 ranks one 24-byte allreduce of a hash), "
        "two collectives per step, on this run's calibration "
        f"(alpha {fit['alpha_s'] * 1e6:.2f} us, {fit['bandwidth_GBps']:.1f} GB/s) inside a "
        "node and the assumed networks between nodes:",
        "",
        "| workload | network | cores | paper | Python engine | native | agreement's share "
        "of a native step at 4096 ranks: hashed (gathered) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in model["paper"]:
        lines.append(
            f"| {r['workload']} | {r['network'].split(' (')[0]} | {r['cores']} | "
            f"{r['paper_speedup']:.2f}x | {r['python_speedup']:.2f}x | "
            f"{r['native_speedup']:.2f}x | {100 * r['native_agreement_share_at_4096']:.1f}% "
            f"({100 * r['native_gathered_agreement_share_at_4096']:.1f}%) |"
        )
    lines.append("")
    return lines


def overhead():
    """One rank's per-call costs (run under mpiexec); prints a JSON line."""
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    import tensorflow as tf
    from mpi4py import MPI

    from mpi_strategy._src.core.protocol import record_bytes
    from mpi_strategy._src.distribute.ordered_comm import OrderedComm
    from mpi_strategy._src.native import engine

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    comm = MPI.COMM_WORLD
    ordered = OrderedComm(comm)
    size = float(comm.Get_size())

    @tf.function
    def with_reduces(x):
        for _ in range(CHAIN):
            x = ordered.allreduce_sum(x) / size
        return x

    @tf.function
    def without(x):
        for _ in range(CHAIN):
            x = x / size
        return x

    def per_call(fn, repeats=200):
        x = tf.constant(1.0)
        fn(x)  # trace
        comm.Barrier()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn(x).numpy()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    chained = statistics.median(per_call(with_reduces) for _ in range(3))
    alone = per_call(without)
    record = np.zeros(record_bytes(comm.Get_size()), np.uint8)
    received = np.empty((comm.Get_size(), record.size), np.uint8)
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(2000):
        comm.Iallgather(record, received).Wait()
    raw = (time.perf_counter() - start) / 2000
    collective = (chained - alone) / CHAIN
    calibration = []  # raw MPI_Allreduce times, for the cost model's alpha and beta
    for nbytes in CALIBRATION_BYTES:
        data = np.zeros(nbytes // 4, np.float32)
        repeats = max(20, min(2000, (1 << 24) // nbytes))
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            comm.Allreduce(MPI.IN_PLACE, data)
        calibration.append([nbytes, (time.perf_counter() - start) / repeats])
    print(
        json.dumps(
            {
                "engine": engine.active(),
                "rank": comm.Get_rank(),
                "collective_us": collective * 1e6,
                "raw_mpi_us": raw * 1e6,
                "overhead_us": (collective - raw) * 1e6,
                "raw_allreduce_s": calibration,
            }
        ),
        flush=True,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--overhead", action="store_true", help="one launch's per-call costs")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.overhead:
        return overhead()
    part = run(args.quick, progress=lambda what: print(what, file=sys.stderr), rounds=args.rounds)
    part["load"] = load_average()
    print(json.dumps(part["summary"], indent=2))
    print("\n".join(markdown(part)), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
