"""Runs this whole test suite again under mpiexec: 2 ranks, 3 ranks, 2 ranks x 2 devices.

Every test module is written to be correct at any world size; here each rank
runs pytest on the same files, so many checks share one TensorFlow start-up.
"""

import os

import pytest

from mpi_strategy._src.core.launch import python_argv, run_mpiexec

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)


@pytest.mark.single_process
@pytest.mark.parametrize("ranks,local_devices", [(2, 1), (3, 1), (2, 2)],
                         ids=["2ranks", "3ranks", "2ranks-x-2devices"])
def test_suite_under_mpiexec(ranks, local_devices, tmp_path):
    code, out = run_mpiexec(
        ranks,
        python_argv("-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", TESTS_DIR),
        env={"MPI_STRATEGY_TEST_LOCAL_DEVICES": str(local_devices),
             "MPI_STRATEGY_TEST_REPORT_DIR": str(tmp_path)},
        cwd=REPO)
    print(out)
    assert code == 0, f"mpiexec -n {ranks} (x{local_devices} devices) failed:\n{out[-20000:]}"
    reports = {}
    for rank in range(ranks):
        report = tmp_path / f"rank{rank}.txt"
        assert report.exists(), f"rank {rank} did not finish its tests:\n{out[-5000:]}"
        reports[rank] = tuple(int(x) for x in report.read_text().split())
    # (exit status, passed, collected) equal on every rank, and tests did run.
    assert all(r == reports[0] for r in reports.values()), reports
    assert reports[0][0] == 0 and reports[0][1] > 0, reports
