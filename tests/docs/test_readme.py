"""README's two commands are the ones CI runs."""

import os
import re

import pytest

from mpi_testing import REPO


def _read(*parts):
    with open(os.path.join(REPO, *parts)) as f:
        return f.read()


@pytest.mark.single_process
def test_ci_runs_the_readme_commands():
    readme, ci = _read("README.md"), _read(".ci", "run")
    first_block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    commands = [line for line in first_block.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2, commands
    example, tests = commands
    assert example.startswith('pip install ".[mpich]" && mpiexec -n 2 python examples/')
    assert example in ci.replace(" --epochs 1", ""), "CI must run README command 1"
    assert tests in ci, "CI must run README command 2"
