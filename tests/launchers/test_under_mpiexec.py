"""Runs tests/any_world_size again under mpiexec: 2 ranks, 3 ranks, 2 ranks x 2 devices.

Every test module there is written to be correct at any world size; here each
rank runs pytest on the same files, so many checks share one TensorFlow
start-up. pytest -q prints a dot per test, so a launch that stops printing
for SILENCE seconds is stuck (every test there takes far less), however
long the whole run takes on a loaded machine.
"""

import itertools
import os
import time

import pytest

from mpi_testing import REPO, TESTS
from testing.launch import DEFAULT_SILENCE, python_argv, run_mpiexec

ANY_WORLD_SIZE = os.path.join(TESTS, "any_world_size")
SILENCE = DEFAULT_SILENCE


# The 2 x 2 launch runs the Python engine (MPI_STRATEGY_KERNELS=python), the
# others the default: the native kernels where a C++ compiler built them
# (else the Python engine, on a machine with only Python and pip). The suite
# passes on both; test_mpi_ops and test_native compare the two engines
# within every launch.
@pytest.mark.single_process
@pytest.mark.parametrize(
    "ranks,local_devices,kernels",
    [(2, 1, "auto"), (3, 1, "auto"), (2, 2, "python")],
    ids=["2ranks", "3ranks", "2ranks-x-2devices-python-engine"],
)
def test_suite_under_mpiexec(ranks, local_devices, kernels, tmp_path):
    arrivals = []  # when each line of output came: the longest gap is printed
    code, out = run_mpiexec(
        ranks,
        python_argv("-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", ANY_WORLD_SIZE),
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
    assert code == 0, f"mpiexec -n {ranks} (x{local_devices} devices) failed:\n{out[-20000:]}"
    reports = {}
    for rank in range(ranks):
        report = tmp_path / f"rank{rank}.txt"
        assert report.exists(), f"rank {rank} did not finish its tests:\n{out[-5000:]}"
        reports[rank] = tuple(int(x) for x in report.read_text().split())
    # (exit status, passed, collected) equal on every rank, and tests did run.
    assert all(r == reports[0] for r in reports.values()), reports
    assert reports[0][0] == 0 and reports[0][1] > 0, reports
