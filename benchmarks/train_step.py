"""Training-step time of an MLP (784-1024-1024-10, global batch 256).

    python -m benchmarks.train_step none            # no strategy, one process
    mpiexec -n K python -m benchmarks.train_step mpi  # MPIStrategy on K ranks
    python -m benchmarks.train_step none --batch 128  # one half of the ceiling pair

Rank 0 prints one JSON line with the median step time of the timed steps.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["none", "mpi"])
    parser.add_argument("--batch", type=int, default=256, help="global batch")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()

    if args.mode == "mpi":
        import mpi_strategy
        strategy = mpi_strategy.MPIStrategy()
    else:
        strategy = tf.distribute.get_strategy()  # the default (no) strategy
    replicas = strategy.num_replicas_in_sync
    per_replica = args.batch // replicas
    rng = np.random.default_rng(0)
    x = tf.constant(rng.random((per_replica, 784), np.float32))
    y = tf.constant(rng.integers(0, 10, per_replica))

    with strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.Input((784,)),
            tf.keras.layers.Dense(1024, activation="relu"),
            tf.keras.layers.Dense(1024, activation="relu"),
            tf.keras.layers.Dense(10),
        ])
        optimizer = tf.keras.optimizers.SGD(0.01)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def replica_step():
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_fn(y, model(x, training=True)),
                                              global_batch_size=args.batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step():
        return strategy.run(replica_step)

    times = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        step()
        model.trainable_variables[0].numpy()  # wait for the step to finish
        times.append(time.perf_counter() - start)
    rank = strategy.cluster_resolver.task_id if args.mode == "mpi" else 0
    if rank == 0:
        print(json.dumps({"mode": args.mode, "replicas": replicas, "global_batch": args.batch,
                          "ms_per_step": float(np.median(times[args.warmup:])) * 1e3}), flush=True)


if __name__ == "__main__":
    main()
