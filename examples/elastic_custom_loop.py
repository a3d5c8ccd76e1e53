"""Elastic training with a custom loop: a lost rank does not end the job.

    mpirun --with-ft ulfm -n 3 python examples/elastic_custom_loop.py

(Open MPI 5 with User-Level Failure Mitigation; kill any rank with SIGKILL
while it trains.) The survivors continue from the last in-memory commit with
the same global batch per step; rank 0 of the survivors prints, as its last
line, one JSON object: ranks at start and at end, steps done, final loss,
the sum of the weights on every rank.
By default every step takes the next ``--global-batch`` examples, whatever the
number of ranks; with ``--per-replica-batch N`` it takes N per replica (fewer
examples per step once ranks are lost). ``--kill R@K`` (repeatable) makes rank
R of the launch kill itself with SIGKILL in the middle of step K (after the
update, before the loss is reduced: the survivors must roll back to undo it;
K = --steps: as the program exits), to try it. With fewer than ``--min-ranks``
survivors the job ends with the last commit saved in ``--state-dir``; launched
again, it resumes from there. With
``--replace-lost``, new processes are started for lost ranks and join at a
commit: the job ends on as many ranks as it started with. ``--shard optimizer``
(or ``gradients``) shards the optimizer's slots over the ranks (ZeRO).
"""

import argparse
import atexit
import hashlib
import json
import os
import signal
import time

import numpy as np
import tensorflow as tf
from mpi4py import MPI

import mpi_strategy


def examples(start, count, features=20, seed=0):
    """Examples ``start`` to ``start + count`` of an endless, fixed stream: the
    data order does not depend on the number of ranks or the batch size."""
    chunks = range(start // 256, (start + count - 1) // 256 + 1)
    x = np.concatenate(
        [np.random.default_rng([seed, c]).standard_normal((256, features)) for c in chunks]
    ).astype(np.float32)[start % 256 :][:count]
    y = (x[:, :5].sum(axis=1) > 0).astype(np.int64)
    return x, y


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--global-batch", type=int, default=96)
    parser.add_argument(
        "--per-replica-batch",
        type=int,
        default=None,
        help="keep this many examples per replica instead of the global batch",
    )
    parser.add_argument("--min-ranks", type=int, default=1)
    parser.add_argument("--state-dir", default="elastic_state")
    parser.add_argument("--commit-every", type=int, default=10)
    parser.add_argument(
        "--kill",
        action="append",
        default=[],
        metavar="RANK@STEP",
        help="rank RANK of the launch kills itself at step STEP",
    )
    parser.add_argument(
        "--pause-ms",
        type=float,
        default=0,
        help="sleep after each step (a slower model: time for replacements)",
    )
    parser.add_argument(
        "--replace-lost",
        action="store_true",
        help="start new processes for lost ranks: they join at a commit",
    )
    parser.add_argument("--shard", choices=["optimizer", "gradients"], default=None)
    args = parser.parse_args()
    launched = not mpi_strategy.elastic.is_replacement()  # not started for a lost rank
    my_kill_steps = {
        int(step)
        for rank, step in (k.split("@") for k in args.kill)
        if int(rank) == MPI.COMM_WORLD.Get_rank() and launched
    }

    if args.steps in my_kill_steps:  # as the program exits: the others are finishing
        atexit.register(lambda: (time.sleep(1), os.kill(os.getpid(), signal.SIGKILL)))
    strategy = mpi_strategy.MPIStrategy(shard=args.shard)
    ranks_at_start = strategy.extended.comm.Get_size()
    with strategy.scope():
        model = tf.keras.Sequential(
            [
                tf.keras.Input((20,)),
                tf.keras.layers.Dense(32, activation="relu"),
                tf.keras.layers.Dense(2),
            ]
        )
        model.set_weights(
            [
                np.cos(np.arange(w.size)).reshape(w.shape).astype(np.float32) * 0.1
                for w in model.get_weights()
            ]
        )
        optimizer = tf.keras.optimizers.SGD(0.05, momentum=0.9)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    state = mpi_strategy.elastic.State(model, optimizer, step=0, examples=0, loss=float("nan"))

    @mpi_strategy.elastic.run(
        strategy,
        state,
        min_ranks=args.min_ranks,
        directory=args.state_dir,
        replace_lost=args.replace_lost,
    )
    def train(state):
        rank = strategy.extended.rank
        replicas = strategy.num_replicas_in_sync
        per_replica = args.per_replica_batch or args.global_batch // replicas
        batch = per_replica * replicas

        @tf.function
        def step_fn(x, y):
            def replica_step(x, y):
                with tf.GradientTape() as tape:
                    loss = tf.nn.compute_average_loss(
                        loss_fn(y, model(x, training=True)), global_batch_size=batch
                    )
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
                return loss

            return strategy.run(replica_step, (x, y))

        while state.step < args.steps:
            x, y = examples(state.examples, batch)
            mine = slice(rank * per_replica, (rank + 1) * per_replica)
            loss = step_fn(tf.constant(x[mine]), tf.constant(y[mine]))
            if state.step in my_kill_steps:  # mid-step: the weights are updated already
                print(json.dumps({"killed_at": time.time()}), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            state.loss = float(strategy.reduce("SUM", loss, axis=None))
            for happened in (recoveries, mpi_strategy.elastic.replacements):
                if happened and "first_step_done_at" not in happened[-1]:
                    happened[-1]["first_step_done_at"] = time.time()  # traced again, stepped
            state.step += 1
            state.examples += batch
            time.sleep(args.pause_ms / 1000)
            if state.step % args.commit_every == 0:
                state.commit()
                if rank == 0:
                    print(
                        f"step {state.step}: loss {state.loss:.4f} on {replicas} ranks", flush=True
                    )

    recoveries = mpi_strategy.elastic.recoveries
    train()
    # Every replica holds the same weights, whichever ranks joined or were lost.
    weights_sum = float(sum(np.sum(w) for w in model.get_weights()))
    digest = hashlib.sha256(b"".join(w.tobytes() for w in model.get_weights())).hexdigest()
    weights_sums = strategy.extended.comm.allgather(weights_sum)
    if strategy.extended.rank == 0:
        print(
            json.dumps(
                {
                    "ranks_at_start": ranks_at_start,
                    "ranks_at_end": strategy.extended.comm.Get_size(),
                    "steps": state.step,
                    "examples": state.examples,
                    "final_loss": state.loss,
                    "weights_sum": weights_sum,
                    "weights_sum_per_rank": weights_sums,
                    "weights_sha256": digest,  # (to compare runs bit for bit)
                    "recoveries": recoveries,
                    "replacements": mpi_strategy.elastic.replacements,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
