"""Runs tests/any_world_size again under mpiexec: 3 ranks, and 2 ranks x 2 devices.

Every test module there is written to be correct at any world size; here each
rank runs pytest on the same files, so many checks share one TensorFlow
start-up. pytest -q prints a dot per test, so a launch that stops printing
for SILENCE seconds is stuck (every test there takes far less), however
long the whole run takes on a loaded machine.
"""

import collections
import itertools
import os
import re
import time

import pytest

from mpi_testing import REPO, TESTS
from testing.launch import DEFAULT_SILENCE, python_argv, run_mpiexec

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
@pytest.mark.slow(
    "every test of tests/any_world_size at 3 ranks and at 2 ranks x 2 devices, one launch each"
)
@pytest.mark.single_process
@pytest.mark.parametrize(
    "ranks,local_devices,kernels",
    [(3, 1, "auto"), (2, 2, "python")],
    ids=["3ranks", "2ranks-x-2devices-python-engine"],
)
def test_suite_under_mpiexec(ranks, local_devices, kernels, tmp_path, capsys):
    started = time.monotonic()
    arrivals = []  # when each line of output came: the longest gap is printed
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
            "MPI_STRATEGY_TEST_LOCAL_DEVICES": str(local_devices),
            "MPI_STRATEGY_KERNELS": kernels,
            "MPI_STRATEGY_TEST_REPORT_DIR": str(tmp_path),
        },
        cwd=REPO,
        each_line=lambda line: arrivals.append(time.monotonic()),
    )
    print(out)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    print(
        f"longest gap between two lines of output: {max(gaps, default=0):.1f} s "
        f"(a launch is killed after {SILENCE:g} s without any output)"
    )
    _report_time(capsys, ranks, local_devices, time.monotonic() - started, out)
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
