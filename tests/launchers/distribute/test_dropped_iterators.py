"""distribute/datasets.py: a dropped iterator of a distributed dataset stops its
prefetch thread first, so that dropping iterators (as Keras 3 does at every
epoch) never crashes the process, on a loaded node too. (That the elements read
stay TensorFlow's own: tests/any_world_size/distribute/test_datasets.py.)"""

import concurrent.futures
import sys

import pytest

from mpi_testing import program, reports
from testing.launch import run_mpiexec

PROCESSES = 4  # on 2 cores: the load under which TensorFlow's race shows
ITERATIONS = 200


@pytest.mark.single_process
@pytest.mark.slow(
    "a race: without the fix 1 to 3 of 4 such processes crash within 200 drops "
    "(SIGSEGV); fewer processes or drops would often miss it"
)
def test_iterators_dropped_right_after_a_read_never_crash_the_process():
    def drop_iterators(_):
        return run_mpiexec(
            1,
            [sys.executable, program("drops_iterators.py"), "mpi", str(ITERATIONS)],
        )

    with concurrent.futures.ThreadPoolExecutor(PROCESSES) as pool:
        results = list(pool.map(drop_iterators, range(PROCESSES)))
    for code, out in results:
        assert code == 0 and reports(out) == [{"survived": ITERATIONS}], (
            f"exit {code}:\n{out[-5000:]}"
        )
