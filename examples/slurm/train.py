"""Preemptible training: TensorFlow's PreemptionCheckpointHandler under MPIStrategy.

    sbatch examples/slurm/train.sbatch                                  # Slurm
    mpiexec -n 2 python examples/slurm/train.py --checkpoint-dir ckpt   # anywhere

Plain tf.distribute code (the only MPI-specific line is ``MPIStrategy()``): a
small network learns the digits of examples/data/ under
``tf.distribute.experimental.PreemptionCheckpointHandler``. When any rank
receives SIGTERM (a scheduler's notice), every rank finishes the same step,
one checkpoint is written to --checkpoint-dir and every rank exits with status
42 (TensorFlow's restart status). Started again, the handler restores that
checkpoint and training goes on from the next step, with the same examples in
the same order as an uninterrupted run. Rank 0 prints the step it starts from
and, at the end, the final loss; the final weights are saved to --checkpoint-dir.
"""

import argparse
import gzip
import os

import numpy as np
import tensorflow as tf

from mpi_strategy import MPIStrategy

DIGITS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "digits.csv.gz")


def load_digits():
    """Images (1797 x 64, in [0, 1]) and labels, the same on every rank."""
    with gzip.open(DIGITS) as f:
        table = np.loadtxt(f, delimiter=",")  # 64 pixels (0-16), then the label
    return (table[:, :-1] / 16).astype(np.float32), table[:, -1].astype(np.int64)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-per-replica", type=int, default=32)
    args = parser.parse_args()

    tf.keras.utils.set_random_seed(0)  # the same initial weights in every run
    strategy = MPIStrategy()
    chief = strategy.cluster_resolver.task_id == 0
    global_batch = args.batch_per_replica * strategy.num_replicas_in_sync
    images, labels = load_digits()

    with strategy.scope():
        model = tf.keras.Sequential(
            [
                tf.keras.Input((64,)),
                tf.keras.layers.Dense(64, activation="relu"),
                tf.keras.layers.Dense(10),
            ]
        )
        optimizer = tf.keras.optimizers.Adam(1e-3)
        optimizer.build(model.trainable_variables)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    manager = tf.train.CheckpointManager(checkpoint, args.checkpoint_dir, max_to_keep=2)
    # Restores the latest checkpoint, if any; watches for SIGTERM.
    handler = tf.distribute.experimental.PreemptionCheckpointHandler(
        strategy.cluster_resolver, manager
    )
    start = int(optimizer.iterations.numpy())  # (saved in the checkpoint)
    if chief:
        print(f"starting at step {start} of {args.steps}", flush=True)

    # One fixed stream of batches: a restart skips the batches already trained on.
    dataset = (
        tf.data.Dataset.from_tensor_slices((images, labels))
        .shuffle(len(labels), seed=0, reshuffle_each_iteration=True)
        .repeat()
        .batch(global_batch, drop_remainder=True)
        .skip(start)
        .take(args.steps - start)
    )
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    @tf.function
    def train_step(batch):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(loss_fn(y, model(x))) / global_batch
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        losses = strategy.run(replica_step, args=batch)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    loss = None
    for step, batch in enumerate(strategy.experimental_distribute_dataset(dataset), start + 1):
        loss = handler.run(train_step, batch)  # saves and exits on a notice
        if chief and step % 50 == 0:
            print(f"step {step}: loss {float(loss):.4f}", flush=True)
    if chief and loss is not None:
        print(f"final loss {float(loss):.4f}", flush=True)
    manager.save()  # every rank saves, rank 0 writes


if __name__ == "__main__":
    main()
