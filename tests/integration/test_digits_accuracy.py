"""Real data: Keras ``fit`` on the shipped digits (examples/digits_cnn.py) reaches
>= 95% test accuracy at 1 and 3 ranks alike (3: an odd world size, uneven
shares; 2 ranks train the same digits in tests/integration/test_examples.py)."""

import json
import os
import sys

import pytest

from mpi_testing import REPO
from testing.launch import run_mpiexec

EXAMPLE = os.path.join(REPO, "examples", "digits_cnn.py")


@pytest.mark.slow("real data to a real accuracy, at two world sizes")
@pytest.mark.single_process
def test_digits_cnn_reaches_the_same_accuracy_at_one_and_three_ranks():
    accuracies = {}
    for ranks in (1, 3):
        code, out = run_mpiexec(ranks, [sys.executable, EXAMPLE], silence=240)
        assert code == 0, out[-5000:]
        line = next(s for s in out.splitlines() if '"test_accuracy"' in s)
        result = json.JSONDecoder().raw_decode(line[line.index("{") :])[0]
        assert result["ranks"] == ranks
        accuracies[ranks] = result["test_accuracy"]
    assert min(accuracies.values()) >= 0.95, accuracies
    assert max(accuracies.values()) - min(accuracies.values()) <= 0.01, accuracies
