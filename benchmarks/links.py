"""Overlap of the gradient all-reduce with the backward pass, on an emulated slow link.

    sudo python -m benchmarks --links        # through the suite: links.json / links.md
    sudo python -m benchmarks.links          # the same part alone, printed as JSON

Two "hosts" (network namespaces, ``testing/netns_cluster.py``) each run one
rank; a ``tc tbf`` rate limit on both hosts' links makes the network the slow
part. On every rank, one after another, in the same order (rounds of):

- ``compute``: the training step without a strategy (forward, backward, SGD) on
  the rank's share of the batch - what the step costs with a free network;
- ``communication``: one all-reduce of the model's gradients (MPIStrategy's
  fused call) on ready tensors - what the step costs with free compute;
- ``step unbucketed``: MPIStrategy, one all-reduce after the backward pass;
- ``step bucketed``: MPIStrategy with ``CommunicationOptions(bytes_per_pack)``:
  the last layers' gradients are reduced while the earlier layers are still
  being differentiated.

Overlap works if the bucketed step is about ``max(compute, communication)``,
no overlap gives about their sum. Each launch runs twice: with MPICH's
default progress engine, which busy-polls while a rank waits in MPI (on these
2 cores the poller takes the core the backward pass needs), and with
``YIELDING_ENV``, which makes the poller sleep a microsecond after a few
thousand idle polls. Needs root (namespaces, tc) and MPICH's hydra; otherwise
the part is skipped with the reason.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks import json_objects, load_average

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# The workload: conv layers (most of the compute, few parameters) under a
# dense layer (84% of the 0.7 MB of gradients, differentiated first): the
# shape of the models that overlap helps (VGG, ResNet with a big classifier).
MODEL = "cnn"
BATCH_PER_RANK = 128
# At this rate the 0.7 MB all-reduce takes about as long as the compute here.
RATE_MBIT = 60
BYTES_PER_PACK = 256 << 10  # 2 buckets: the dense layers, then the convolutions
ROUNDS, STEPS, WARMUP = 3, 12, 3
QUICK = (1, 5, 2)
LAUNCH_TIMEOUT = 600
# MPICH CVARs: the ch4 progress loop sleeps 1 us after this many polls that
# made no progress, instead of spinning (see `mpivars`).
YIELDING_ENV = {
    "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1",
    "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "64",
}
SETTINGS = {"busy-polling (MPICH default)": {}, "yielding (progress throttle)": YIELDING_ENV}


# -- on every rank -----------------------------------------------------------------------------
def measure_on_rank(model, batch, bytes_per_pack, rounds, steps, warmup):
    """This rank's median ms of each phase over ``rounds`` (every rank runs the same phases)."""
    import tensorflow as tf
    from mpi4py import MPI

    import mpi_strategy
    from benchmarks import models, train_step
    from mpi_strategy import MPICrossDeviceOps

    world = MPI.COMM_WORLD
    options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=bytes_per_pack)
    unbucketed, bucketed = (
        mpi_strategy.MPIStrategy(),
        mpi_strategy.MPIStrategy(communication_options=options),
    )
    ops = MPICrossDeviceOps(world)
    grads = [tf.random.normal(s) for s in models.gradient_shapes(model)]
    reduce_once = tf.function(lambda: ops.all_reduce_values("SUM", grads, bytes_per_pack=0))
    global_batch = batch * world.Get_size()
    phases = {
        "compute": lambda: train_step.run_model(
            model, tf.distribute.get_strategy(), batch, steps, warmup
        )["ms_per_step"],
        "communication": lambda: _median_ms(lambda: reduce_once()[-1].numpy(), steps, warmup),
        "step unbucketed": lambda: train_step.run_model(
            model, unbucketed, global_batch, steps, warmup
        )["ms_per_step"],
        "step bucketed": lambda: train_step.run_model(model, bucketed, global_batch, steps, warmup)[
            "ms_per_step"
        ],
    }
    by_phase = {name: [] for name in phases}
    for _ in range(rounds):
        for name, run in phases.items():
            world.Barrier()
            by_phase[name].append(run())
    sizes = [4 * int(tf.size(g)) for g in grads]
    from mpi_strategy._src.distribute import fusion

    return {
        "rank": world.Get_rank(),
        "ms": {k: sorted(v)[len(v) // 2] for k, v in by_phase.items()},
        "ms_per_round": by_phase,
        "gradient_bytes": sum(sizes),
        "buckets_bytes": [sum(sizes[i] for i in b) for b in fusion.buckets(sizes, bytes_per_pack)],
    }


def _median_ms(fn, steps, warmup):
    times = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    timed = sorted(times[warmup:])
    return timed[len(timed) // 2] * 1e3


# -- on the launching node ---------------------------------------------------------------------
def unavailable_reason():
    """Why the emulated links cannot be built here, or None."""
    from testing import netns_cluster
    from testing.launch import is_open_mpi

    reason = netns_cluster.unavailable_reason()
    if reason is None and is_open_mpi():
        reason = "the namespace launcher agent is written for MPICH's hydra mpiexec"
    return reason


def run(
    quick=False,
    rate_mbit=RATE_MBIT,
    model=MODEL,
    batch=BATCH_PER_RANK,
    bytes_per_pack=BYTES_PER_PACK,
    progress=print,
):
    """The part's results: {"skipped": why} or one entry per MPICH progress setting."""
    reason = unavailable_reason()
    if reason:
        return {"skipped": f"--links needs root and network namespaces: {reason}"}
    from testing import netns_cluster
    from testing.launch import mpiexec_command, mpiexec_env

    rounds, steps, warmup = QUICK if quick else (ROUNDS, STEPS, WARMUP)
    result = {
        "model": model,
        "batch_per_rank": batch,
        "rate_mbit": rate_mbit,
        "bytes_per_pack": bytes_per_pack,
        "ranks": 2,
        "rounds": rounds,
        "steps": steps,
        "settings": {},
    }
    try:
        cluster = netns_cluster.NetnsCluster(2).__enter__()
    except netns_cluster.NetnsUnavailable as e:
        return {"skipped": f"--links: cannot create network namespaces here ({e})"}
    try:
        for host in cluster.hosts:  # both directions of the link are slow
            for command in cluster.shaping_commands(rate_mbit=rate_mbit):
                subprocess.run(cluster.exec_argv(host, *command), check=True, timeout=60)
        for label, env in SETTINGS.items():
            progress(f"links: {model} at {rate_mbit} Mbit/s, {label}")
            argv = (
                mpiexec_command(2)
                + cluster.mpiexec_args()
                + [
                    sys.executable,
                    "-m",
                    "benchmarks.links",
                    "--worker",
                    "--model",
                    model,
                    "--batch",
                    str(batch),
                    "--bytes-per-pack",
                    str(bytes_per_pack),
                    "--rounds",
                    str(rounds),
                    "--steps",
                    str(steps),
                    "--warmup",
                    str(warmup),
                ]
            )
            launch_env = {**cluster.mpi_env(), **mpiexec_env(2), **env}
            result["settings"][label] = _launch(argv, launch_env)
            result["settings"][label]["env"] = env
    finally:
        cluster.close()
    return result


def _launch(argv, env, timeout=LAUNCH_TIMEOUT):
    load_before = load_average()
    proc = subprocess.run(
        argv,
        cwd=REPO,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    rows = [r for r in json_objects(proc.stdout) if "ms" in r]
    if proc.returncode != 0 or len(rows) != 2:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-3000:]}", "load": load_before}
    # A step is as slow as its slowest rank.
    ms = {k: max(r["ms"][k] for r in rows) for k in rows[0]["ms"]}
    return {
        "ms": ms,
        **verdict(ms),
        "per_rank": rows,
        "load_before": load_before,
        "load_after": load_average(),
    }


def verdict(ms):
    """How the steps compare with compute + communication and with their maximum."""
    compute, comm = ms["compute"], ms["communication"]
    bound = max(compute, comm)
    return {
        "sum_ms": compute + comm,
        "max_ms": bound,
        "unbucketed_over_max": ms["step unbucketed"] / bound,
        "unbucketed_over_sum": ms["step unbucketed"] / (compute + comm),
        "bucketed_over_max": ms["step bucketed"] / bound,
        "bucketed_over_unbucketed": ms["step bucketed"] / ms["step unbucketed"],
        "target_bucketed_over_max": 1.3,
        "target_met": ms["step bucketed"] <= 1.3 * bound,
    }


def markdown(part):
    """The part as markdown lines (for latest.md / links.md)."""
    lines = ["### Overlap on an emulated slow link (`python -m benchmarks --links`)", ""]
    if "skipped" in part:
        return [*lines, f"Skipped: {part['skipped']}", ""]
    lines += [
        f"2 ranks on 2 network-namespace hosts, `tc tbf` {part['rate_mbit']} Mbit/s "
        f"each way; model `{part['model']}`, batch {part['batch_per_rank']} per rank, "
        f"`bytes_per_pack={part['bytes_per_pack']}`; medians of {part['rounds']} "
        f"rounds of {part['steps']} steps, slowest rank.",
        "",
        "| MPICH progress | compute ms | communication ms | step unbucketed ms "
        "| step bucketed ms | unbucketed / sum | bucketed / max | target <= 1.3 | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, s in part["settings"].items():
        if "error" in s:
            lines.append(f"| {label} | error: {s['error'][:200]!r} | | | | | | | {s['load']} |")
            continue
        ms = s["ms"]
        lines.append(
            f"| {label} | {ms['compute']:.0f} | {ms['communication']:.0f} "
            f"| {ms['step unbucketed']:.0f} | {ms['step bucketed']:.0f} "
            f"| {s['unbucketed_over_sum']:.2f} | {s['bucketed_over_max']:.2f} "
            f"| {'met' if s['target_met'] else 'not met'} "
            f"| {s['load_before']} -> {s['load_after']} |"
        )
    return [*lines, ""]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help="(internal) one rank's measurement")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--batch", type=int, default=BATCH_PER_RANK, help="per rank")
    parser.add_argument("--rate-mbit", type=float, default=RATE_MBIT)
    parser.add_argument("--bytes-per-pack", type=int, default=BYTES_PER_PACK)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--warmup", type=int, default=WARMUP)
    args = parser.parse_args()
    if args.worker:
        row = measure_on_rank(
            args.model, args.batch, args.bytes_per_pack, args.rounds, args.steps, args.warmup
        )
        print(json.dumps(row), flush=True)
        return
    part = run(
        args.quick,
        args.rate_mbit,
        args.model,
        args.batch,
        args.bytes_per_pack,
        progress=lambda s: print(s, file=sys.stderr, flush=True),
    )
    print(json.dumps(part, indent=2))
    print("\n".join(markdown(part)), file=sys.stderr)


if __name__ == "__main__":
    main()
