"""Smoke tests: each example runs under mpiexec -n 2 and prints its result from rank 0."""

import os
import sys

import pytest

from launch import run_mpiexec

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


@pytest.mark.single_process
@pytest.mark.parametrize("script,args,expected", [
    ("custom_loop.py", ["--epochs", "1", "--examples", "2048"], "epoch 1: loss"),
    ("keras_fit.py", ["--epochs", "1"], "test loss"),
])
def test_example_runs_on_two_ranks(script, args, expected, tmp_path):
    if script == "keras_fit.py":
        args = args + ["--output", str(tmp_path)]
    code, out = run_mpiexec(2, [sys.executable, os.path.join(EXAMPLES, script), *args],
                            timeout=240)
    assert code == 0, out[-5000:]
    results = [line for line in out.splitlines() if expected in line]
    assert len(results) == 1, out[-5000:]  # printed by rank 0 only
