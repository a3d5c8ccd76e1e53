"""Runs tests/any_world_size again under mpiexec: 3 ranks, and 2 ranks x 2
devices, the two launches at once, started as soon as the session has
collected these tests (``start_early_launches``).

Every test module there is written to be correct at any world size; here each
rank runs pytest on the same files, so many checks share one TensorFlow
start-up. pytest -q prints a dot per test, so a launch that stops printing
for SILENCE seconds is stuck (every test there takes far less), however
long the whole run takes on a loaded machine.
"""

import collections
import concurrent.futures
import itertools
import os
import pathlib
import re
import tempfile
import threading
import time

import pytest

from mpi_testing import REPO, TESTS
from testing.launch import DEFAULT_SILENCE, polite_env, python_argv, run_mpiexec

ANY_WORLD_SIZE = os.path.join(TESTS, "any_world_size")
SILENCE = DEFAULT_SILENCE


# Two launches cover what differs between world sizes: 3 ranks (an odd
# number, uneven shares) with the native kernels where a C++ compiler built
# them (else the Python engine, on a machine with only Python and pip), and 2
# ranks x 2 devices with the Python engine (MPI_STRATEGY_KERNELS=python). 2
# ranks x 1 device adds no case of its own: CI runs the core modules so under
# the oldest TensorFlow (.ci/oldest), and a launch costs minutes.
# test_ordered_comm and test_native compare the two engines within every launch
# that has both.
LAUNCHES = {
    "3ranks": (3, 1, "auto"),
    "2ranks-x-2devices-python-engine": (2, 2, "python"),
}


_BACKGROUND = concurrent.futures.ThreadPoolExecutor(1)
_STARTED: list[concurrent.futures.Future] = []
_CANCEL = threading.Event()


def start_early_launches() -> None:
    """Starts both launches now, in the background (tests/conftest.py calls it
    once this module's tests are collected in a 1-rank session): they run
    beside the 1-rank tests, which leave a core idle, and beside each other
    (while one launch waits for a reference that rank 0 computes alone, the
    other has the cores)."""
    if not _STARTED:
        base = pathlib.Path(tempfile.mkdtemp(prefix="mpi-strategy-under-mpiexec-"))
        _STARTED.append(_BACKGROUND.submit(_launch_both, base))


def stop_early_launches() -> None:
    """Kills the launches if they still run (the session ended first)."""
    _CANCEL.set()


def _launched():
    """{id: (code, out, seconds, longest gap between two lines of output,
    report directory)} of both launches, started now if not yet."""
    start_early_launches()
    return _STARTED[0].result()


def _launch_both(base):
    with concurrent.futures.ThreadPoolExecutor(len(LAUNCHES)) as pool:
        futures = {
            name: pool.submit(_launch, *shape, base / name) for name, shape in LAUNCHES.items()
        }
        return {name: future.result() for name, future in futures.items()}


def _launch(ranks, local_devices, kernels, reports):
    reports.mkdir(parents=True)
    started = time.monotonic()
    arrivals = []
    code, out = run_mpiexec(
        ranks,
        python_argv(
            "-m",
            "pytest",
            "-x",
            "-q",
            "-p",
            "no:cacheprovider",
            "--durations=0",
            "--durations-min=0.2",
            ANY_WORLD_SIZE,
        ),
        silence=SILENCE,
        env={
            # (the two launches run beside each other and the 1-rank tests)
            **polite_env(),
            "MPI_STRATEGY_TEST_LOCAL_DEVICES": str(local_devices),
            "MPI_STRATEGY_KERNELS": kernels,
            "MPI_STRATEGY_TEST_REPORT_DIR": str(reports),
        },
        cwd=REPO,
        each_line=lambda line: arrivals.append(time.monotonic()),
        cancel=_CANCEL,
    )
    gap = max((b - a for a, b in itertools.pairwise(arrivals)), default=0)
    return code, out, time.monotonic() - started, gap, reports


@pytest.mark.slow(
    "every test of tests/any_world_size at 3 ranks and at 2 ranks x 2 devices, one launch each"
)
@pytest.mark.single_process
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_suite_under_mpiexec(launch, capsys):
    ranks, local_devices, _ = LAUNCHES[launch]
    code, out, seconds, gap, tmp_path = _launched()[launch]
    print(out)
    print(
        f"longest gap between two lines of output: {gap:.1f} s "
        f"(a launch is killed after {SILENCE:g} s without any output)"
    )
    _report_time(capsys, ranks, local_devices, seconds, out)
    assert code == 0, f"mpiexec -n {ranks} (x{local_devices} devices) failed:\n{out[-20000:]}"
    reports = {}
    for rank in range(ranks):
        report = tmp_path / f"rank{rank}.txt"
        assert report.exists(), f"rank {rank} did not finish its tests:\n{out[-5000:]}"
        reports[rank] = tuple(int(x) for x in report.read_text().split())
    # (exit status, passed, collected) equal on every rank, and tests did run.
    assert all(r == reports[0] for r in reports.values()), reports
    assert reports[0][0] == 0 and reports[0][1] > 0, reports


# "[0] 1.23s call     tests/...::test" (MPICH's -prepend-rank; Open MPI's
# --tag-output writes "[1,0]<stdout>: ...")
_DURATION = re.compile(
    r"^(?:\[[\d,]+\](?:<stdout>:)?\s*)?([0-9.]+)s (?:setup|call|teardown) +(tests/[^:]+)"
)


def _report_time(capsys, ranks, local_devices, seconds, out):
    """Prints, even when the launch passes, where its time went: the seconds
    per test module (the mean over ranks), so that CI's log shows what to cut."""
    per_rank_module = collections.Counter()
    for line in out.splitlines():
        found = _DURATION.match(line)
        if found:  # every rank prints its list; they interleave
            per_rank_module[found[2]] += float(found[1])
    per_module = {m: t / ranks for m, t in per_rank_module.items()}
    slowest = sorted(per_module.items(), key=lambda kv: -kv[1])[:8]
    with capsys.disabled():  # (pytest shows a passing test's output nowhere)
        print(
            f"\n[{ranks} ranks x {local_devices}] {seconds:.0f} s in all; "
            "slowest modules (mean over ranks): "
            + ", ".join(f"{os.path.basename(m)} {t:.0f} s" for m, t in slowest)
        )
