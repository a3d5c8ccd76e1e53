"""Run by tests/launchers/features/elastic/test_elastic.py under ULFM: an elastic program whose
survivors, at each commit, wait for the replacements to be ready before they
decide, so that the replacements join at the first commit after the recovery
however long TensorFlow takes to start on a busy machine.

    python tests/programs/replacements_awaited.py PROGRAM [ARGS...]

Runs PROGRAM (an elastic program run with ``--replace-lost``) as ``__main__``
with ARGS. The replacements run this wrapper too (they are started with this
process's command line); they make no decision, so nothing changes for them.
"""

import runpy
import sys
import time

from mpi_strategy._src.features.elastic import replacement

decide = replacement.Spawning.decide


def decide_once_ready(self):
    # decide() is collective over the survivors: they loop in step.
    while (decision := decide(self)) == replacement.WAIT:
        time.sleep(0.2)
    return decision


replacement.Spawning.decide = decide_once_ready
path, args = sys.argv[1], sys.argv[2:]
sys.argv = [path, *args]
runpy.run_path(path, run_name="__main__")
