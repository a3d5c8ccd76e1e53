"""Sharded optimizer state and gradients (``MPIStrategy(shard=...)``) against the replicated step.

    python -m benchmarks.sharding                  # 1, 2, 3, 4 ranks; mlp and cnn
    python -m benchmarks.sharding --quick          # fewer steps
    python -m benchmarks.sharding --memory --ranks 2,4   # peak resident memory
    mpiexec -n K python -m benchmarks.sharding --worker mlp,cnn   # one launch

Per launch of K ranks and per model (Adam, the custom loop of train_step.py),
the variants live in the same processes and are timed in alternating rounds
(these VMs drift 2x between runs; a ratio measured side by side does not):
stage 0 (``MPIStrategy()``), stage 1 (``shard="optimizer"``) and stage 2
(``shard="gradients"``). Each rank reports the bytes of optimizer state it
holds (its slots' elements: a slot held by another rank is a placeholder of
0 elements), the bytes of summed gradients it receives per step (stage 2: its
share's, which are Adam's slot bytes / 2; else all of them) and the median
step time. The targets: optimizer state per rank <= 1/K of the replicated
state plus the largest variable's slots, and each stage's step within 5% of
stage 0's. (The gradients each rank's backward pass makes are whole in every
stage: TensorFlow computes them before any collective.)

``--memory``: the peak resident memory of each rank (``ru_maxrss``) training
a wide MLP (3 layers of 2048 x 2048 and one of 2048 x 10, 12.6M parameters:
48 MiB of weights, 96 MiB of Adam's slots) for a few steps, one launch per
stage (a process's peak is its own).
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

STAGES = {"stage 0": None, "stage 1": "optimizer", "stage 2": "gradients"}
GLOBAL_BATCH = {"mlp": 256, "cnn": 128}


def _worker(model_names, steps, rounds):
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    import keras

    import mpi_strategy
    from benchmarks import models

    for name in model_names:
        variants = {}
        for stage, shard in STAGES.items():
            strategy = mpi_strategy.MPIStrategy(shard=shard)
            x, y = models.batch(name, GLOBAL_BATCH[name] // strategy.num_replicas_in_sync)
            with strategy.scope():
                model = models.build(name)
                optimizer = keras.optimizers.Adam(1e-3)
                optimizer.build(model.trainable_variables)
            variants[stage] = (
                _step(strategy, model, optimizer, x, y, GLOBAL_BATCH[name]),
                optimizer,
            )
        times = {stage: [] for stage in STAGES}
        for step, _ in variants.values():
            for _ in range(3):  # warm-up (traced)
                step()
        for _ in range(rounds):
            for stage, (step, _) in variants.items():
                for _ in range(steps):
                    start = time.perf_counter()
                    step()
                    times[stage].append(time.perf_counter() - start)
        row = {
            "model": name,
            "ranks": strategy.extended.comm.Get_size(),
            "rank": strategy.extended.rank,  # (the last strategy's: the same comm)
            "parameters": int(
                sum(np.prod(v.shape) for v in variants["stage 0"][1].variables[2:]) // 2
            ),
            "largest_unit": max(
                int(np.prod(v.shape)) * 4 * 2 for v in variants["stage 0"][1].variables[2:]
            ),
        }
        gradient_bytes = 4 * row["parameters"]
        for stage, (_, optimizer) in variants.items():
            held = int(
                sum(v.value.shape.num_elements() * v.value.dtype.size for v in optimizer.variables)
            )
            row[f"{stage} bytes"] = held
            slots = sum(v.value.shape.num_elements() * 4 for v in optimizer.variables[2:])
            row[f"{stage} gradient bytes"] = (
                slots // 2 if STAGES[stage] == "gradients" else gradient_bytes
            )  # (Adam's two slots per variable; after the step count and learning rate)
            row[f"{stage} ms"] = 1000 * statistics.median(times[stage])
        print(json.dumps(row), flush=True)


WIDE = (2048, 4)  # units, layers of the --memory MLP


def _memory_worker(shard, steps):
    """One rank's peak resident memory (MiB) training the wide MLP ``steps`` steps."""
    import resource

    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    import keras

    import mpi_strategy

    strategy = mpi_strategy.MPIStrategy(shard=shard)
    units, layers = WIDE
    batch = 64 // strategy.num_replicas_in_sync
    rng = np.random.default_rng(strategy.extended.rank)
    x = tf.constant(rng.normal(size=(batch, units)).astype(np.float32))
    y = tf.constant(rng.integers(0, 10, batch))
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((units,))]
            + [keras.layers.Dense(units, activation="relu") for _ in range(layers - 1)]
            + [keras.layers.Dense(10)]
        )
        optimizer = keras.optimizers.Adam(1e-4)
    step = _step(strategy, model, optimizer, x, y, 64)
    for _ in range(steps):
        step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"shard": shard or "", "rank": strategy.extended.rank, "peak": peak}))


def _memory_table(world_sizes, steps):
    """Peak resident memory per rank for each stage, one launch each."""
    from benchmarks.launching import launch_together, python_module
    from testing.launch import mpiexec_command, mpiexec_env

    lines = [
        "| ranks | stage | peak resident memory per rank | / stage 0 |",
        "| ---: | --- | ---: | ---: |",
    ]
    failed = []
    for ranks in world_sizes:
        base = None
        for stage, shard in STAGES.items():
            command = mpiexec_command(ranks) + python_module(
                "benchmarks.sharding", "--memory-worker", shard or "none", "--steps", str(steps)
            )
            rows, error = launch_together([(command, mpiexec_env(ranks))])
            if error:
                failed.append(f"{ranks} ranks, {stage}: {error}")
                continue
            peak = max(r["peak"] for r in rows)
            base = peak if shard is None else base
            ratio = f"{peak / base:.3f}" if base else ""
            lines.append(f"| {ranks} | {stage} | {peak:.0f} MiB | {ratio} |")
    return "\n".join(lines), failed


def _step(strategy, model, optimizer, x, y, global_batch):
    import tensorflow as tf

    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def replica_step():
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                loss_fn(y, model(x, training=True)), global_batch_size=global_batch
            )
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def step():
        strategy.run(replica_step)

    def run():
        step()
        model.trainable_variables[0].numpy()  # (waits for the step)

    return run


def _table(rows):
    """The Markdown table: per model, world size and stage, the largest rank's figures."""
    lines = [
        "| model | ranks | stage | optimizer state per rank | / stage 0 "
        "| target (1/N + largest variable) | summed gradients per rank (computed) "
        "| step ms | / stage 0 |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    by_launch = {}
    for row in rows:
        by_launch.setdefault((row["model"], row["ranks"]), []).append(row)
    for (model, ranks), launch in sorted(by_launch.items()):
        full = max(r["stage 0 bytes"] for r in launch)
        bound = full / ranks + launch[0]["largest_unit"]
        ms0 = statistics.median(r["stage 0 ms"] for r in launch)
        for stage in STAGES:
            held = max(r[f"{stage} bytes"] for r in launch)
            grads = max(r[f"{stage} gradient bytes"] for r in launch)
            ms = statistics.median(r[f"{stage} ms"] for r in launch)
            target = f"{bound / 2**20:.2f} MiB{'' if held <= bound else ' (missed)'}"
            lines.append(
                f"| {model} | {ranks} | {stage} | {held / 2**20:.2f} MiB | {held / full:.2f} | "
                f"{target if stage != 'stage 0' else ''} | {grads / 2**20:.2f} MiB | "
                f"{ms:.1f} | {ms / ms0:.3f} |"
            )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", metavar="MODELS", help="run in this launch (under mpiexec)")
    parser.add_argument("--memory", action="store_true", help="peak resident memory per stage")
    parser.add_argument("--memory-worker", metavar="SHARD", help="(under mpiexec) one stage")
    parser.add_argument("--ranks", default="1,2,3,4", help="world sizes (default 1,2,3,4)")
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--quick", action="store_true", help="few steps: does it run here?")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    args = parser.parse_args(argv)
    steps = args.steps or (2 if args.quick else 10)
    if args.worker:
        _worker(args.worker.split(","), steps, 1 if args.quick else args.rounds)
        return 0
    if args.memory_worker:
        _memory_worker(None if args.memory_worker == "none" else args.memory_worker, steps)
        return 0
    from benchmarks import load_average

    if args.memory:
        table, failed = _memory_table([int(k) for k in args.ranks.split(",")], steps)
        print(f"Peak resident memory, wide MLP (Adam), load average {load_average()}\n")
        print(table)
        for line in failed:
            print(f"\nFAILED {line}")
        return 1 if failed else 0
    from benchmarks.launching import launch_together, python_module
    from testing.launch import mpiexec_command, mpiexec_env

    rows, failed = [], []
    for ranks in (int(k) for k in args.ranks.split(",")):
        command = mpiexec_command(ranks) + python_module(
            "benchmarks.sharding",
            "--worker",
            args.models,
            "--steps",
            str(steps),
            "--rounds",
            str(1 if args.quick else args.rounds),
        )
        got, error = launch_together([(command, mpiexec_env(ranks))])
        rows += got
        if error:
            failed.append(f"{ranks} ranks: {error}")
    print(f"Sharded optimizer state and gradients (Adam), load average {load_average()}\n")
    print(_table(rows))
    for line in failed:
        print(f"\nFAILED {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
