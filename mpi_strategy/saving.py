"""Saving from a multi-rank job: every rank takes part, rank 0's copy is kept.

Reading a metric (a sync-on-read variable) is a collective, and Keras saves
metric state with the model (tf_keras always; Keras 3 when metrics hold
state), so a save called on rank 0 alone can wait forever for the others.
The safe pattern is for every rank to call the same save, and for only rank 0
to write to the real destination.
"""

import contextlib
import os
import shutil
import tempfile

from mpi4py import MPI


@contextlib.contextmanager
def only_chief_writes(path, comm=None):
    """Yields where this rank should save ``path``.

    Rank 0 of ``comm`` (default ``COMM_WORLD``) gets ``path``; every other
    rank gets a path of the same name in a scratch directory that is deleted
    when the block ends. After the block, every rank can read ``path`` (all
    ranks wait for rank 0's write)::

        with mpi_strategy.only_chief_writes("model.keras") as path:
            model.save(path)
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    if comm.Get_rank() == 0:
        yield path
    else:
        scratch = tempfile.mkdtemp(prefix=f"mpi_strategy-rank{comm.Get_rank()}-")
        try:
            yield os.path.join(scratch, os.path.basename(os.path.normpath(path)))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    comm.Barrier()  # not reached on error: a failing rank must not stall the others here
