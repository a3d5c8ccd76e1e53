"""Real data: scikit-learn's digits reach >= 95% test accuracy at 1, 2 and 3 ranks alike."""

import json
import os
import sys

import pytest

from mpi_testing import REPO
from testing.launch import run_mpiexec

EXAMPLE = os.path.join(REPO, "examples", "digits_cnn.py")


@pytest.mark.single_process
def test_digits_cnn_accuracy_at_every_world_size():
    accuracies = {}
    for ranks in (1, 2, 3):
        code, out = run_mpiexec(ranks, [sys.executable, EXAMPLE], silence=240)
        assert code == 0, out[-5000:]
        line = next(s for s in out.splitlines() if '"test_accuracy"' in s)
        result = json.JSONDecoder().raw_decode(line[line.index("{") :])[0]
        assert result["ranks"] == ranks
        accuracies[ranks] = result["test_accuracy"]
    assert min(accuracies.values()) >= 0.95, accuracies
    assert max(accuracies.values()) - min(accuracies.values()) <= 0.01, accuracies
