"""Security properties of a training job (stated in docs/security.md).

One 2-rank launch (tests/programs/security_report.py) records, on every rank:

* the listening sockets of the process (``/proc/net/tcp``, ``tcp6`` and
  ``unix`` entries in LISTEN state whose inode is one of this process's file
  descriptors) right after ``MPI.Init``, and again after MPIStrategy has been
  built and has trained (custom loop and Keras fit / evaluate / predict);
* how many times mpi4py unpickled or pickled data during that training (its
  pickle hooks, ``MPI.pickle.__init__(dumps, loads)``, count every call);
* the permission bits of every file and directory written by
  ``tf.train.Checkpoint`` / ``CheckpointManager``, Keras ``model.save``
  (``.keras``), ``model.export`` and ``tf.saved_model.save`` through
  every rank's same call, under umask 022 and 077.
"""

import json
import os
import re
import sys

import pytest

from mpi_testing import REPO, program
from testing.launch import run_mpiexec

UMASKS = (0o022, 0o077)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Every rank's report of one 2-rank launch of tests/programs/security_report.py, by rank."""
    workdir = tmp_path_factory.mktemp("security")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    code, out = run_mpiexec(
        2,
        [sys.executable, program("security_report.py"), str(workdir / "out")],
        silence=240,
        env=env,
    )
    assert code == 0, out[-5000:]
    plain = re.sub(r"\[\d+\] ?", "", out)
    # Other ranks' output may be joined to a report line: decode just the object.
    decoder = json.JSONDecoder()
    found = [decoder.raw_decode(plain, m.end())[0] for m in re.finditer("REPORT ", plain)]
    by_rank = {r["rank"]: r for r in found}
    assert sorted(by_rank) == [0, 1], out[-5000:]
    return by_rank


@pytest.mark.single_process
def test_no_listening_socket_beyond_what_mpi_init_opened(reports):
    for rank, report in reports.items():
        new = set(report["after_training"]) - set(report["after_init"])
        assert not new, f"rank {rank} listens on {sorted(new)} after training"


@pytest.mark.single_process
def test_nothing_is_unpickled_in_the_training_path(reports):
    for rank, report in reports.items():
        assert report["hooks_work"], f"rank {rank}: the pickle hooks saw nothing"
        assert report["during_training"]["loads"] == 0, (rank, report["during_training"])


@pytest.mark.single_process
@pytest.mark.parametrize("umask", UMASKS, ids=lambda m: f"umask{m:03o}")
def test_checkpoints_and_exports_follow_the_umask(reports, umask):
    modes = {
        path: mode
        for path, mode in reports[0]["modes"].items()
        if path.split(os.sep)[0] == f"umask{umask:03o}"
    }
    # One of each kind of output was written (on rank 0, in the real place).
    for part in (
        "manager/checkpoint",
        "plain/ckpt.index",
        "model.keras",
        "export/saved_model.pb",
        "saved_model/saved_model.pb",
        "saved_model/variables",
    ):
        assert os.path.join(f"umask{umask:03o}", part) in modes, sorted(modes)
    too_open = {path: oct(mode) for path, mode in modes.items() if mode & (umask | 0o7000)}
    assert not too_open, f"more permissive than umask {umask:03o} allows: {too_open}"
    assert reports[1]["modes"] == {}  # rank 1 wrote nothing
