"""Benchmarks for mpi_strategy: run ``python -m benchmarks`` (see docs/benchmarks.md)."""

import json
import subprocess


def json_objects(text):
    """Every JSON object in ``text``: mpiexec may put two ranks' lines on one line."""
    decoder, objects, pos = json.JSONDecoder(), [], 0
    while (start := text.find("{", pos)) >= 0:
        try:
            obj, pos = decoder.raw_decode(text, start)
            objects.append(obj)
        except json.JSONDecodeError:
            pos = start + 1
    return objects


def load_average():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def slowest_rank_ms(argv, cwd, env):
    """{model: ms per step} of one launch of ``benchmarks.train_step`` (``argv``):
    per model, the slowest rank's median (a step is as slow as its slowest rank)."""
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    rows = [r for r in json_objects(out.stdout) if "ms_per_step" in r]
    if out.returncode or not rows:
        raise RuntimeError(
            f"{argv}: exit {out.returncode}\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
        )
    times = {}
    for row in rows:
        times.setdefault(row["model"], []).append(row["ms_per_step"])
    return {model: max(ms) for model, ms in times.items()}
