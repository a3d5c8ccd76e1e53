"""Runs this whole test suite again under mpiexec: 2 ranks, 3 ranks, 2 ranks x 2 devices.

Every test module is written to be correct at any world size; here each rank
runs pytest on the same files, so many checks share one TensorFlow start-up.
"""

import os

import pytest

from launch import python_argv, run_mpiexec

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)


@pytest.mark.single_process
@pytest.mark.parametrize("ranks,local_devices", [(2, 1), (3, 1), (2, 2)],
                         ids=["2ranks", "3ranks", "2ranks-x-2devices"])
def test_suite_under_mpiexec(ranks, local_devices):
    code, out = run_mpiexec(
        ranks,
        python_argv("-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", TESTS_DIR),
        env={"MPI_STRATEGY_TEST_LOCAL_DEVICES": str(local_devices)},
        cwd=REPO)
    print(out)
    assert code == 0, f"mpiexec -n {ranks} (x{local_devices} devices) failed:\n{out[-20000:]}"
    passed_lines = [line for line in out.splitlines() if " passed" in line]
    assert len(passed_lines) >= ranks, f"not every rank reported its tests:\n{out[-5000:]}"
