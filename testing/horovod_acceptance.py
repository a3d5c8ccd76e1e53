"""Horovod's own TensorFlow test suite, run on mpi_strategy.horovod (by hand).

    python -m testing.horovod_acceptance --horovod-git /path/to/horovod/.git --ranks 2 3
    python -m testing.horovod_acceptance --horovod-tree /path/to/horovod --legacy-keras

Horovod's tests are not copied into this repository: they are read from a
checkout of Horovod (a work tree, or a bare git directory at ``--rev``) into a
scratch directory, unchanged. The test setup (a conftest.py written there)
only makes ``import horovod...`` resolve to ``mpi_strategy.horovod``, stands
in for two helpers its tests import that are not its API (the launcher's
``horovod.runner.util.threads.in_thread``, the version check
``horovod.common.util.is_version_greater_equal_than``), then records every
test's and subtest's outcome per rank (a module that fails to import, as a
failure). Runs each test module of ``--tests`` (default: all of ``TESTS``)
under ``mpiexec -n N`` for each N, one launch per module, and prints, per
module, the counts and every test not passed with the reason, then a JSON
summary. ``--legacy-keras``: TF_USE_LEGACY_KERAS=1 (Horovod's tests are
written for Keras 2: ``var.ref()``, ``fused=``, ``opt.lr``,
``experimental_run_tf_function``). Needs pytest, cloudpickle, mock and
parameterized (Horovod's tests and test utilities import them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter

from testing.launch import DEFAULT_SILENCE, run_mpiexec

FILES = {
    "test/parallel/test_tensorflow.py": "parallel/test_tensorflow.py",
    "test/parallel/base_test_tensorflow.py": "parallel/base_test_tensorflow.py",
    "test/parallel/test_tensorflow2_keras.py": "parallel/test_tensorflow2_keras.py",
    "test/parallel/test_tensorflow_keras.py": "parallel/test_tensorflow_keras.py",
    "test/utils/common.py": "utils/common.py",
}
# The test modules run, each in its own launch (test_tensorflow_keras.py is
# Horovod's TensorFlow 1 Keras suite: its class skips itself on TensorFlow 2).
TESTS = ("test_tensorflow.py", "test_tensorflow2_keras.py", "test_tensorflow_keras.py")

CONFTEST = """
import json, os, sys, threading, types
from mpi4py import MPI
from mpi_strategy._src.horovod import aliases

aliases.install()
# The launcher helper Horovod's test utilities import (not part of its API).
threads = types.ModuleType("horovod.runner.util.threads")
def in_thread(target, args=(), name=None, daemon=True, silent=False):
    thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)
    thread.start()
    return thread
threads.in_thread = in_thread
for name in ("horovod.runner", "horovod.runner.util"):
    sys.modules[name] = types.ModuleType(name)
sys.modules["horovod.runner.util.threads"] = threads
# The version helper its Keras tests import (not part of its API either).
from packaging.version import Version
util = types.ModuleType("horovod.common.util")
def is_version_greater_equal_than(ver, target):
    return Version(ver) >= Version(target)
util.is_version_greater_equal_than = is_version_greater_equal_than
sys.modules["horovod.common"] = types.ModuleType("horovod.common")
sys.modules["horovod.common.util"] = util

OUTCOMES = {}

def pytest_runtest_logreport(report):
    context = getattr(report, "context", None)
    name = report.nodeid.split("::")[-1]
    if context is not None and getattr(context, "msg", None):
        name += " [" + str(context.msg) + "]"
    if report.when != "call" and not (report.failed or report.skipped):
        return
    reason = ""
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2])
    elif report.failed:
        reason = str(report.longrepr).strip().splitlines()[-1][:300]
    if OUTCOMES.get(name, ("",))[0] != "failed":
        OUTCOMES[name] = (report.outcome, reason)

def pytest_collectreport(report):
    if report.failed:  # (a module that does not import: its tests never report)
        OUTCOMES[report.nodeid + " (collection)"] = ("failed", str(report.longrepr)[-300:])

def pytest_sessionfinish(session):
    path = os.path.join(os.environ["HVD_ACCEPTANCE_OUT"], f"rank{MPI.COMM_WORLD.Get_rank()}.json")
    with open(path, "w") as f:
        json.dump(OUTCOMES, f)
"""


def extract(scratch: str, git_dir: str | None, tree: str | None, rev: str) -> str:
    """Writes Horovod's test files into ``scratch``; returns the test directory."""
    for source, target in FILES.items():
        path = os.path.join(scratch, target)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if git_dir:
            text = subprocess.run(
                ["git", "--git-dir", git_dir, "show", f"{rev}:{source}"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        else:
            with open(os.path.join(str(tree), source)) as f:
                text = f.read()
        with open(path, "w") as f:
            f.write(text)
    with open(os.path.join(scratch, "parallel", "conftest.py"), "w") as f:
        f.write(CONFTEST)
    return os.path.join(scratch, "parallel")


def run(tests: str, module: str, ranks: int, legacy_keras: bool, out: str) -> dict[str, list[str]]:
    """{test: [outcome, reason]} of the test module ``module`` as rank 0 saw it
    (a test whose outcome differs between ranks is reported as failed on the
    rank that failed)."""
    os.makedirs(out, exist_ok=True)
    env = {"HVD_ACCEPTANCE_OUT": out, "PYTHONPATH": os.getcwd()}
    if legacy_keras:
        env["TF_USE_LEGACY_KERAS"] = "1"
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module]
    code, text = run_mpiexec(ranks, argv, silence=DEFAULT_SILENCE, env=env, cwd=tests)
    merged: dict[str, list[str]] = {}
    for rank in range(ranks):
        path = os.path.join(out, f"rank{rank}.json")
        if not os.path.exists(path):
            raise RuntimeError(f"rank {rank} did not finish (exit {code}):\n{text[-5000:]}")
        with open(path) as f:
            for name, (outcome, reason) in json.load(f).items():
                if name not in merged or outcome == "failed":
                    merged[name] = [
                        outcome,
                        reason if outcome != "failed" else f"rank {rank}: {reason}",
                    ]
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--horovod-git", help="a git directory of horovod (bare is fine)")
    source.add_argument("--horovod-tree", help="a work tree of horovod")
    parser.add_argument("--rev", default="HEAD")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--legacy-keras", action="store_true")
    parser.add_argument("--tests", nargs="+", choices=TESTS, default=list(TESTS))
    args = parser.parse_args(argv)
    summary: dict[int, dict[str, object]] = {}
    with tempfile.TemporaryDirectory(prefix="hvd-acceptance-") as scratch:
        tests = extract(scratch, args.horovod_git, args.horovod_tree, args.rev)
        for ranks in args.ranks:
            summary[ranks] = {}
            for module in args.tests:
                out = os.path.join(scratch, f"n{ranks}", module)
                results = run(tests, module, ranks, args.legacy_keras, out)
                counts = Counter(outcome for outcome, _ in results.values())
                print(f"\n== {module}, {ranks} ranks: {dict(counts)}", flush=True)
                for name in sorted(results):
                    outcome, reason = results[name]
                    if outcome != "passed":
                        print(f"{outcome:8s} {name}: {reason}")
                summary[ranks][module] = {"counts": dict(counts), "tests": results}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
