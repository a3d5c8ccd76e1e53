"""Test setup shared by the 1-rank run and the ranks of every mpiexec launch.

The one conftest of the suite: it applies to every folder under tests/ (see
docs/contributing.md for the layout). Each process gets ``world size x local
devices`` logical CPU devices, so the reference
``tf.distribute.MirroredStrategy`` over all of them has exactly as many
replicas as the ``MPIStrategy`` under test has across ranks.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# The shared helpers (mpi_testing) sit here, above the folders of tests.
TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from mpi_testing import LOCAL_DEVICES, WORLD  # noqa: E402

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration()] * (WORLD.Get_size() * LOCAL_DEVICES),
)
tf.config.threading.set_intra_op_parallelism_threads(1)


def pytest_collection_modifyitems(config, items):
    for item in items:  # a slow test says why it must stay (CI's time limit)
        for mark in item.iter_markers("slow"):
            if len(mark.args) != 1 or not str(mark.args[0]).strip():
                raise pytest.UsageError(f'{item.nodeid}: @pytest.mark.slow("why it must stay")')
    # Under mpiexec every rank must run the same tests in the same order.
    if WORLD.Get_size() > 1:
        items[:] = [i for i in items if "single_process" not in i.keywords]
    # The ranks x devices run is for what builds a strategy on the local devices.
    if LOCAL_DEVICES > 1:
        items[:] = [i for i in items if "device_agnostic" not in i.keywords]


def pytest_collection_finish(session):
    # tests/launchers/test_under_mpiexec.py's launches start now, beside the
    # 1-rank tests (in one process, which leave a core idle): CI's time.
    if WORLD.Get_size() == 1 and not session.config.option.collectonly:
        for module in _modules(session):
            if hasattr(module, "start_early_launches"):
                module.start_early_launches()


def _modules(session):
    return {item.module for item in getattr(session, "items", []) if hasattr(item, "module")}


_exit_status = [0]


def pytest_sessionfinish(session, exitstatus):
    _exit_status[0] = int(exitstatus)
    for module in _modules(session):
        if hasattr(module, "stop_early_launches"):
            module.stop_early_launches()  # (if the session did not wait for them)
    # Under test_under_mpiexec.py, every rank reports how its run ended.
    report_dir = os.environ.get("MPI_STRATEGY_TEST_REPORT_DIR")
    if report_dir:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        passed = len(reporter.stats.get("passed", [])) if reporter else -1
        with open(os.path.join(report_dir, f"rank{WORLD.Get_rank()}.txt"), "w") as f:
            f.write(f"{int(exitstatus)} {passed} {session.testscollected}\n")


def pytest_unconfigure(config):
    # A rank whose tests failed ends the whole job: the other ranks may be
    # waiting in a collective of a test this rank never reached.
    if _exit_status[0] not in (0, 5) and WORLD.Get_size() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        WORLD.Abort(_exit_status[0])


@pytest.fixture(scope="module")
def strategy():
    """The MPIStrategy under test: all ranks, LOCAL_DEVICES devices each."""
    from mpi_testing import mpi_strategy_under_test

    return mpi_strategy_under_test()


@pytest.fixture
def shared_dir(tmp_path):
    """One directory that every rank names (rank 0's tmp_path)."""
    return WORLD.bcast(str(tmp_path), root=0)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "single_process: runs only outside mpiexec (e.g. launches mpiexec itself)"
    )
    config.addinivalue_line(
        "markers",
        "device_agnostic: uses no strategy's local devices (not rerun with 2 devices per rank)",
    )
    config.addinivalue_line(
        "markers",
        "slow(why): takes 30 s or more in CI; says why it must stay (-m 'not slow' leaves it out)",
    )


@pytest.fixture(scope="session")
def slurm():
    """A real Slurm cluster (testing/slurm_cluster.py), started once per pytest run:
    2 nodes (network namespaces), else 1 node; skipped without the packages or root."""
    from testing import slurm_cluster

    cluster, reason = slurm_cluster.for_tests()
    if cluster is None:
        pytest.skip(reason)
    try:
        yield cluster
    finally:
        cluster.close()
