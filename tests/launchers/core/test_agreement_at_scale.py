"""core/agreement.py, core/protocol.py and core/collectives.py at 40 ranks
(oversubscribed, no TensorFlow).

Beyond 32 ranks the agreement record shrinks (``protocol.record_bytes``);
no other test runs more than 4 ranks. 130 ranks were run by hand
(``mpiexec -n 130 python tests/programs/agreement_at_scale.py``).
"""

import sys

import pytest

from mpi_testing import program
from testing.launch import run_mpiexec


@pytest.mark.single_process
def test_agreement_and_collectives_at_40_ranks():
    code, out = run_mpiexec(40, [sys.executable, program("agreement_at_scale.py")], silence=300)
    # 408 bytes a record, of which the signature takes 8 x 11 (protocol.Field).
    assert code == 0 and "OK 40 ranks, record 408 bytes, carried 320" in out, out[-5000:]
