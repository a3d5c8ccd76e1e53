"""Launching benchmark processes: several at once, each printing JSON lines.

Shared by ``python -m benchmarks`` and its parts (``benchmarks.kernels``).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

from benchmarks import json_objects
from testing.launch import mpiexec_command, mpiexec_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROCESS_TIMEOUT = 420  # seconds for one launch; a hung variant is killed and recorded


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("localhost", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def launch_together(commands, timeout=PROCESS_TIMEOUT):
    """Starts every ``(argv, extra_env)`` at once; returns (JSON rows, error or None).

    Each process prints JSON lines; a non-zero exit, a timeout or a row with an
    ``error`` field makes the error text, so the caller records it as the
    variant's result instead of dropping the row.
    """
    procs = []
    for argv, extra_env in commands:
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **extra_env)
        procs.append(
            subprocess.Popen(
                argv,
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    deadline = time.monotonic() + timeout
    rows, errors = [], []
    for proc, (argv, _) in zip(procs, commands):
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:  # kill the whole variant: its peers would wait forever
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            out, err = proc.communicate()
            errors.append(f"timeout after {timeout} s: {' '.join(argv)}")
        rows.extend(json_objects(out))
        if proc.returncode != 0:
            tail = "\n".join(err.strip().splitlines()[-15:])
            errors.append(f"exit {proc.returncode}: {' '.join(argv)}\n{tail}")
    errors.extend(r["error"] for r in rows if r.get("error"))
    return rows, ("\n".join(errors) or None)


def python_module(*args):
    return [sys.executable, "-m", *args]


def train_variant(model, variant, ranks, batch, steps, warmup, env=None):
    """One row of the training table: median ms/step, samples/s, peak RSS per
    process. ``env``: extra environment for every process of the variant."""
    step_args = ["--batch", str(batch), "--steps", str(steps), "--warmup", str(warmup)]
    script = python_module("benchmarks.train_step", model)
    if variant == "no_strategy":
        commands = [([*script, "none", *step_args], {})]
    elif variant == "mpi_1_rank":
        commands = [([*script, "mpi", *step_args], {})]
    elif variant == "mpi":
        commands = [([*mpiexec_command(ranks), *script, "mpi", *step_args], mpiexec_env(ranks))]
    elif variant == "mwms":
        cluster = {"worker": [f"localhost:{p}" for p in _free_ports(ranks)]}
        commands = [
            (
                [*script, "mwms", *step_args],
                {
                    "TF_CONFIG": json.dumps(
                        {"cluster": cluster, "task": {"type": "worker", "index": i}}
                    )
                },
            )
            for i in range(ranks)
        ]
    elif variant == "ceiling":
        # Independent processes, each with its share of the batch, at the same time.
        half = ["--batch", str(batch // ranks), "--steps", str(steps), "--warmup", str(warmup)]
        commands = [([*script, "none", *half], {}) for _ in range(ranks)]
    else:
        raise ValueError(variant)
    commands = [(argv, {**extra, **(env or {})}) for argv, extra in commands]
    start = time.monotonic()
    rows, error = launch_together(commands)
    good = [r for r in rows if "ms_per_step" in r]
    result = {
        "model": model,
        "variant": variant,
        "global_batch": batch,
        "processes": len(commands) if variant != "mpi" else ranks,
        "wall_s": time.monotonic() - start,
        "error": error,
        "per_process": rows,
    }
    if good and not error:
        ms = max(r["ms_per_step"] for r in good)  # a step is as slow as its slowest rank
        result.update(
            ms_per_step=ms,
            samples_per_s=batch / ms * 1e3,
            peak_rss_mb=[r["peak_rss_mb"] for r in good],
            params=good[0]["params"],
            grad_types_after_reduce=good[0]["grad_types_after_reduce"],
            grad_types_before_reduce=good[0]["grad_types_before_reduce"],
        )
    return result
