"""Makes the repository root importable wherever pytest is started from.

``testing`` (the launcher and the namespace cluster shared by tests and
benchmarks) and ``benchmarks`` live at the root and are not installed. pytest
loads this file for every test under the root (``python -m pytest tests``,
``cd tests/launchers && python -m pytest test_x.py``, each rank under
mpiexec) and, in its default import mode, puts this directory on ``sys.path``;
the insertion below does the same in any import mode. The test setup itself
is ``tests/conftest.py``.
"""

import os
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
