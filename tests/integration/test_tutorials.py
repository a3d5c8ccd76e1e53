"""TensorFlow's own distributed-training tutorials as an acceptance test.

Each program in tests/programs/tutorials/ makes the calls of one tutorial of
tensorflow/docs (site/en/tutorials/distribute/ and the distributed training
guide) in the tutorial's order, changed only in its strategy line and its data
(see tests/programs/tutorials/_tutorial.py). run_all.py runs them one after another in
one process: once per Keras (tf_keras for the tutorials written for it, Keras 3
for the others) under ``mpiexec -n 2`` with MPIStrategy, and once in a single
process with MirroredStrategy on two devices. Every tutorial must run to its
end under both, every rank must report rank 0's numbers, and those must be
MirroredStrategy's. The programs of run_all.AT_OTHER_SHAPES run at 3 ranks and
at 2 ranks x 2 devices too (against MirroredStrategy on 3 and 4 devices), and
those of run_all.SHARDED under MPIStrategy(shard="gradients") at 2 ranks.

A launch in which a rank got stuck (in a collective that a failed rank never
joins) is aborted by run_all.py; the tutorials after the stuck one then run in
a new launch, so that each tutorial is reported.
"""

import concurrent.futures
import glob
import json
import os
import re
import sys
import time

import numpy as np
import pytest

from mpi_testing import REPO, program
from testing.launch import polite_env, run_launcher, run_mpiexec

TUTORIALS_DIR = program("tutorials")
RUN_ALL = os.path.join(TUTORIALS_DIR, "run_all.py")
sys.path.insert(0, TUTORIALS_DIR)
from run_all import (  # noqa: E402
    AT_OTHER_SHAPES,
    NOT_AS_MIRRORED,
    OWN_ON_EACH_RANK,
    SHARDED,
    TUTORIALS,
)

# {shape: (ranks, devices per rank, programs)}
SHAPES = {
    "2ranks": (2, 1, list(TUTORIALS)),
    "3ranks": (3, 1, list(AT_OTHER_SHAPES)),
    "2ranks-x-2devices": (2, 2, list(AT_OTHER_SHAPES)),
    "2ranks-shard-gradients": (2, 1, list(SHARDED)),
}
# Shapes whose MPIStrategy takes another argument too (the user's other
# one-line choice, TUTORIAL_SHARD), compared with the MirroredStrategy run of
# the shape named: the same numbers are expected (at 2 ranks a sharded step
# sums in the same order).
OTHER_ARGUMENT = {"2ranks-shard-gradients": ("gradients", "2ranks")}
# The tutorials import mpi_strategy from this checkout, wherever it is installed.
ENV = {
    "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
    "TF_CPP_MIN_LOG_LEVEL": "2",
}
# Seconds without output after which a launch counts as stuck.
LAUNCH_SILENCE = float(os.environ.get("TUTORIAL_LAUNCH_TIMEOUT", "300"))
# MPIStrategy with one device per rank splits every batch as MirroredStrategy
# does and sums the two replicas' values in the same order: the same
# arithmetic up to float rounding (reductions in another association, oneDNN
# kernels per process), well inside 1e-4 over these few steps.
RTOL = ATOL = 1e-4


def _groups(names):
    """{keras: [tutorial, ...]} of ``names``, in run_all.py's order."""
    groups = {}
    for name, keras in TUTORIALS.items():
        if name in names:
            groups.setdefault(keras, []).append(name)
    return groups


def _read_results(workdir):
    """{tutorial: {rank: result}} from the files that run_all.py wrote."""
    results = {}
    for path in glob.glob(os.path.join(workdir, "results", "*.json")):
        with open(path) as f:
            result = json.load(f)
        results.setdefault(result["tutorial"], {})[result["rank"]] = result
    return results


def _run_mpi(workdir, keras, names, launches, ranks, local_devices, shard=""):
    """Runs ``names`` under mpiexec, relaunching after a tutorial that got stuck.

    Returns {tutorial: {rank: result}} and {tutorial: why it has no result on every rank}.
    """
    stuck = {}
    remaining = list(names)
    while remaining:
        argv = [sys.executable, RUN_ALL, "--keras", keras, workdir, *remaining]
        start = time.monotonic()
        try:
            code, out = run_mpiexec(
                ranks,
                argv,
                silence=LAUNCH_SILENCE,
                env=dict(
                    ENV,
                    **polite_env(),  # (beside the MirroredStrategy process)
                    TUTORIAL_STRATEGY="mpi",
                    TUTORIAL_LOCAL_DEVICES=str(local_devices),
                    TUTORIAL_SHARD=shard,
                ),
            )
        except AssertionError as timeout:  # run_mpiexec's TIMEOUT, with the output
            code, out = "timeout", str(timeout)
        shape = f"{ranks}x{local_devices}" + (f" shard={shard}" if shard else "")
        launches.append(
            (f"mpi {shape} {keras}: {' '.join(remaining)}", time.monotonic() - start, code)
        )
        _save_log(workdir, f"mpi-{keras}-{len(launches)}.log", out)
        results = _read_results(workdir)
        done = [n for n in remaining if len(results.get(n, {})) == ranks]
        unfinished = [n for n in remaining if n not in done]
        if not unfinished:
            if code != 0:
                stuck[f"(launch {keras})"] = (
                    f"every tutorial finished, but mpiexec exited with {code}:\n{_tail(out)}"
                )
            break
        first = unfinished[0]
        missing = sorted(set(range(ranks)) - set(results.get(first, {})))
        stuck[first] = (
            f"rank(s) {missing} did not finish it (mpiexec: {code}); "
            f"end of the output:\n{_tail(out)}"
        )
        remaining = remaining[remaining.index(first) + 1 :]
    return _read_results(workdir), stuck


def _run_mirrored(workdir, keras, names, launches, ranks, local_devices):
    argv = [sys.executable, RUN_ALL, "--keras", keras, workdir, *names]
    start = time.monotonic()
    env = dict(
        ENV,
        TUTORIAL_STRATEGY="mirrored",
        TUTORIAL_WORKERS=str(ranks),
        TUTORIAL_LOCAL_DEVICES=str(local_devices),
    )
    try:
        code, out = run_launcher(argv, silence=LAUNCH_SILENCE, env=env)
    except AssertionError as timeout:  # run_launcher's TIMEOUT, with the output
        code, out = "timeout", str(timeout)
    launches.append((f"mirrored {ranks}x{local_devices} {keras}", time.monotonic() - start, code))
    _save_log(workdir, f"mirrored-{keras}.log", out)
    return {name: reports.get(0) for name, reports in _read_results(workdir).items()}


def _tail(out, lines=40):
    """The end of a launch's output, without TensorFlow's log noise and progress bars."""
    noise = ("I0000 ", "W0000 ", "E0000 ", "\u2501", "WARNING: All log messages")
    kept = [line for line in out.splitlines() if not any(n in line for n in noise)]
    return "\n".join(kept[-lines:])


def _save_log(workdir, name, text):
    with open(os.path.join(workdir, name), "w") as f:
        f.write(text)


def differences(ours, theirs, where="", unlike=(), exact=False):
    """Where two reports differ: numbers beyond RTOL/ATOL (any difference if
    ``exact``), anything else at all; the values (not the keys or lengths)
    under a path starting with one of ``unlike`` are not compared."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        if sorted(ours) != sorted(theirs):
            return [f"{where or 'report'}: keys {sorted(ours)} != {sorted(theirs)}"]
        return [
            d
            for k in sorted(ours)
            for d in differences(ours[k], theirs[k], f"{where}.{k}", unlike, exact)
        ]
    if isinstance(ours, list) and isinstance(theirs, list):
        if len(ours) != len(theirs):
            return [f"{where}: {len(ours)} items != {len(theirs)}: {ours} vs {theirs}"]
        return [
            d
            for i, (a, b) in enumerate(zip(ours, theirs))
            for d in differences(a, b, f"{where}[{i}]", unlike, exact)
        ]
    if where.startswith(tuple(unlike)):
        return []
    numbers = (int, float)
    if (
        isinstance(ours, numbers)
        and isinstance(theirs, numbers)
        and not isinstance(ours, bool)
        and not isinstance(theirs, bool)
    ):
        if ours == theirs or (not exact and np.isclose(ours, theirs, rtol=RTOL, atol=ATOL)):
            return []
    elif ours == theirs:
        return []
    return [f"{where}: {ours!r} != {theirs!r}"]


def _last_line(error):
    return error.strip().splitlines()[-1] if error else "ok"


@pytest.mark.slow(
    "TensorFlow's tutorials and the ecosystem's programs, changed in the strategy line only, "
    "under MPI and Mirrored: the README's promise, tried on programs nobody here wrote"
)
@pytest.mark.single_process
def test_tutorials_run_under_mpi_as_under_mirrored_strategy(tmp_path):
    started = time.monotonic()
    launches, mpi, stuck, mirrored = [], {}, {}, {}

    def run_under_mpi():
        for shape, (ranks, local_devices, programs) in SHAPES.items():
            for keras, names in _groups(programs).items():
                workdir = str(tmp_path / shape / f"mpi-{keras}")
                os.makedirs(workdir)
                shard = OTHER_ARGUMENT.get(shape, ("",))[0]
                results, why = _run_mpi(
                    workdir, keras, names, launches, ranks, local_devices, shard
                )
                mpi.update({(shape, n): results.get(n, {}) for n in names})
                stuck.update({(shape, n): text for n, text in why.items()})

    def run_under_mirrored():
        for shape, (ranks, local_devices, programs) in SHAPES.items():
            if shape in OTHER_ARGUMENT:
                continue  # (compared with another shape's run)
            for keras, names in _groups(programs).items():
                workdir = str(tmp_path / shape / f"mirrored-{keras}")
                os.makedirs(workdir)
                results = _run_mirrored(workdir, keras, names, launches, ranks, local_devices)
                mirrored.update({(shape, n): results.get(n) for n in names})

    # Side by side, every shape in one test: the references' one process
    # mostly leaves a core to the ranks (which then outnumber the cores: they
    # wait politely), and either side's last launches fill the other's tail.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(run_under_mpi), pool.submit(run_under_mirrored)]:
            done.result()

    problems, table = [], []
    for shape, (ranks, _, programs) in SHAPES.items():
        table.append(f"== {shape}")
        for name in programs:
            key = (shape, name)
            reference = mirrored.get((OTHER_ARGUMENT.get(shape, ("", shape))[1], name))
            reports = mpi.get(key, {})
            if shape in OTHER_ARGUMENT:
                reference, reports = _data_files_counted_once(reference, reports)
            row, found = _compare(name, reference, reports, ranks, stuck.get(key))
            table.extend(row)
            problems.extend(f"[{shape}] {problem}" for problem in found)
    problems += [
        f"[{shape}] {what}: {why}" for (shape, what), why in stuck.items() if what.startswith("(")
    ]
    wall = time.monotonic() - started
    table.append(
        "launches: "
        + "; ".join(f"{what}: {secs:.1f} s (exit {code})" for what, secs, code in launches)
    )
    table.append(f"wall time of the whole test: {wall:.1f} s")
    print("\n".join(table))
    assert not problems, "\n".join(table) + "\n\n" + "\n\n".join(problems)


# A sharded optimizer's checkpoint holds a data file per rank that wrote a
# part (docs/sharding.md), where MirroredStrategy's holds one: file names
# listed in a report are compared without that count.
_DATA_FILE = re.compile(r"(\.data)-\d{5}-of-\d{5}$")


def _data_files_counted_once(*reports):
    """The reports with each checkpoint data file name a list holds cut to
    ``<prefix>.data``, each such name listed once."""

    def cut(value):
        if isinstance(value, dict):
            return {k: cut(v) for k, v in value.items()}
        if isinstance(value, list):
            names = [_DATA_FILE.sub(r"\1", v) if isinstance(v, str) else cut(v) for v in value]
            return [
                v
                for i, v in enumerate(names)
                if not _DATA_FILE.search(str(value[i])) or v not in names[:i]
            ]
        return value

    return [cut(r) for r in reports]


def _compare(name, reference, reports, ranks, stuck):
    """One program's rows of the table and its problems: it ran on every rank
    and under MirroredStrategy, every rank reports rank 0's numbers, and those
    are MirroredStrategy's (but for run_all.py's named differences)."""
    problems = []
    row = [
        f"{name} ({TUTORIALS[name]}):",
        "  mirrored: " + ("no result" if reference is None else _last_line(reference["error"])),
    ]
    if reference is None or not reference["ok"]:
        problems.append(
            f"{name} failed under MirroredStrategy: "
            + (reference["error"] if reference else "no result")
        )
    for rank in range(ranks):
        result = reports.get(rank)
        if result is None:
            row.append(f"  mpi rank {rank}: no result (stuck; see below)")
            problems.append(f"{name}: no result from rank {rank} under MPIStrategy: {stuck}")
            continue
        row.append(f"  mpi rank {rank}: {_last_line(result['error'])} ({result['seconds']} s)")
        if not result["ok"]:
            problems.append(f"{name} failed on rank {rank} under MPIStrategy:\n" + result["error"])
    complete = [reports.get(r) for r in range(ranks)]
    if not all(r is not None and r["ok"] for r in complete):
        return row, problems
    own, _ = OWN_ON_EACH_RANK.get(name, ((), ""))
    for rank in range(1, ranks):
        diff = differences(complete[rank]["numbers"], complete[0]["numbers"], "", own, exact=True)
        if diff:
            problems.append(f"{name}: rank {rank} reports other numbers than rank 0: {diff[:10]}")
    if reference is not None and reference["ok"]:
        unlike, why = NOT_AS_MIRRORED.get(name, ((), ""))
        diff = differences(complete[0]["numbers"], reference["numbers"], "", unlike)
        if unlike:
            row.append(f"  not compared with mirrored: {', '.join(unlike)}: {why}")
        if own:
            row.append(f"  rank 0's only: {', '.join(own)}: {OWN_ON_EACH_RANK[name][1]}")
        if diff:
            problems.append(
                f"{name}: MPIStrategy's numbers differ from MirroredStrategy's: "
                + "; ".join(diff[:10])
            )
    return row, problems
