"""The Estimator-style lifecycle end to end under mpiexec -n 1, 2 and 3.

Two runs train examples/estimator_style.py to step 6 (checkpoints at 3 and 6),
are relaunched from their last checkpoint and train to step 10: one on one
rank, one on 2 ranks and then 3 (another number of ranks, an odd one, uneven
shares); each evaluates and exports.
The final evaluation must agree across world sizes (same global batch), and
every export must serve in a plain Python process that imports neither MPI
nor mpi_strategy (tests/programs/serve_exports.py).
"""

import json
import os
import sys

import numpy as np
import pytest

from mpi_testing import REPO, program
from testing.launch import run_launcher, run_mpiexec

EXAMPLE = os.path.join(REPO, "examples", "estimator_style.py")


def launch(ranks, model_dir, steps):
    code, out = run_mpiexec(
        ranks,
        [
            sys.executable,
            EXAMPLE,
            "--model-dir",
            model_dir,
            "--train-steps",
            str(steps),
            "--checkpoint-every",
            "3",
        ],
        silence=240,
        cwd=REPO,
    )
    assert code == 0, out[-10000:]
    lines = [line for line in out.splitlines() if line.lstrip("[0] ").startswith("{")]
    assert len(lines) == 1, f"expected one result line from rank 0:\n{out[-5000:]}"
    # stderr shares the pipe: decode the JSON object and ignore what follows it.
    return json.JSONDecoder().raw_decode(lines[0][lines[0].index("{") :])[0]


@pytest.mark.slow(
    "train, checkpoint, resume on another number of ranks, export, serve: one lifecycle"
)
@pytest.mark.single_process
def test_train_checkpoint_resume_evaluate_export_serve(tmp_path):
    plans = {"1": (1, 1), "2-then-3": (2, 3)}
    finals = {}
    for name, (first, second) in plans.items():
        model_dir = str(tmp_path / name)
        early = launch(first, model_dir, steps=6)
        assert early["resumed_from_step"] == 0 and early["ranks"] == first
        checkpoints = sorted(os.listdir(os.path.join(model_dir, "checkpoints")))
        assert "ckpt-3.index" in checkpoints and "ckpt-6.index" in checkpoints, checkpoints
        finals[name] = launch(second, model_dir, steps=10)
        assert finals[name]["resumed_from_step"] == 6 and finals[name]["ranks"] == second

    reference = finals["1"]
    assert reference["eval_accuracy"] > 0.7  # it learned something
    for name, result in finals.items():
        for key in ("eval_loss", "eval_accuracy", "last_train_loss"):
            np.testing.assert_allclose(
                result[key], reference[key], rtol=1e-4, err_msg=f"{name} {key}"
            )

    sys.path.insert(0, os.path.dirname(EXAMPLE))
    try:
        from estimator_style import make_data
    finally:
        sys.path.pop(0)
    held_out = str(tmp_path / "held_out.npz")
    features, labels = make_data(300, seed=2)  # the example's evaluation data
    np.savez(held_out, features=features, labels=labels)
    exports = [str(tmp_path / name / "export") for name in plans]
    code, out = run_launcher([sys.executable, program("serve_exports.py"), held_out, *exports])
    assert code == 0, out[-5000:]
    [line] = [line for line in out.splitlines() if line.startswith("{")]  # (its only print)
    accuracies = json.loads(line)
    for path, accuracy in accuracies.items():
        assert accuracy == pytest.approx(reference["eval_accuracy"], abs=1e-6), path
