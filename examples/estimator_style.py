"""The tf.estimator lifecycle, without tf.estimator: for users migrating from Estimator.

    mpiexec -n 2 python examples/estimator_style.py --model-dir /tmp/run --train-steps 200
    # resumes from the checkpoint in /tmp/run, on 4 ranks:
    mpiexec -n 4 python examples/estimator_style.py --model-dir /tmp/run --train-steps 400

``input_fn(input_context)`` builds the input pipeline of one rank, ``model_fn()``
the model, loss and optimizer; ``train`` runs to ``--train-steps`` global steps
with a checkpoint every ``--checkpoint-every`` steps, resuming from the last
checkpoint in ``--model-dir`` (written by any number of ranks); ``evaluate``
runs on held-out data; ``export`` writes a SavedModel that serves with plain
TensorFlow. The global input stream depends only on the global step, so a run
resumed with a different number of ranks continues on the same examples.
"""

import argparse
import json
import os

import numpy as np
import tensorflow as tf

import mpi_strategy

FEATURES, CLASSES = 10, 3


def make_data(n, seed):
    """A deterministic, learnable classification problem (no download)."""
    rng = np.random.default_rng(seed)
    centers = np.random.default_rng(0).normal(size=(CLASSES, FEATURES)).astype(np.float32)
    labels = rng.integers(0, CLASSES, n)
    features = centers[labels] + rng.normal(scale=1.0, size=(n, FEATURES)).astype(np.float32)
    return features, labels.astype(np.int64)


def input_fn(input_context, global_batch, start_step=0, train=True):
    """One rank's pipeline: the global stream from ``start_step``, this rank's share."""
    features, labels = make_data(2048 if train else 300, seed=1 if train else 2)
    dataset = tf.data.Dataset.from_tensor_slices((features, labels))
    if train:
        dataset = dataset.repeat().skip(start_step * global_batch)
    dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return dataset.batch(input_context.get_per_replica_batch_size(global_batch))


def model_fn():
    model = tf.keras.Sequential(
        [
            tf.keras.Input((FEATURES,)),
            tf.keras.layers.Dense(
                32,
                activation="relu",
                kernel_initializer=tf.keras.initializers.GlorotUniform(seed=1),
            ),
            tf.keras.layers.Dense(
                CLASSES, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=2)
            ),
        ]
    )
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    optimizer = tf.keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)
    return model, loss, optimizer


def train(strategy, model, loss_fn, optimizer, args):
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    manager_dir = os.path.join(args.model_dir, "checkpoints")
    latest = tf.train.latest_checkpoint(manager_dir)
    if latest:
        checkpoint.restore(latest).assert_existing_objects_matched()
    start = int(optimizer.iterations.numpy())
    dataset = strategy.distribute_datasets_from_function(
        lambda ctx: input_fn(ctx, args.global_batch, start_step=start)
    )

    @tf.function
    def step(batch):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(
                    loss_fn(y, model(x, training=True)), global_batch_size=args.global_batch
                )
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return strategy.reduce("SUM", strategy.run(replica_step, args=batch), axis=None)

    iterator = iter(dataset)
    loss = None
    for global_step in range(start + 1, args.train_steps + 1):
        loss = float(step(next(iterator)))
        if global_step % args.checkpoint_every == 0 or global_step == args.train_steps:
            # Every rank saves, as one process would; rank 0 writes the files.
            tf.train.CheckpointManager(checkpoint, manager_dir, max_to_keep=3).save(
                checkpoint_number=global_step
            )
    return start, loss


def evaluate(strategy, model, loss_fn, global_batch):
    with strategy.scope():
        mean_loss = tf.keras.metrics.Mean()
        accuracy = tf.keras.metrics.SparseCategoricalAccuracy()
    dataset = strategy.distribute_datasets_from_function(
        lambda ctx: input_fn(ctx, global_batch, train=False)
    )

    @tf.function
    def step(batch):
        def replica_step(x, y):
            logits = model(x, training=False)
            mean_loss.update_state(loss_fn(y, logits))
            accuracy.update_state(y, logits)

        strategy.run(replica_step, args=batch)

    for batch in dataset:
        step(batch)
    return {"eval_loss": float(mean_loss.result()), "eval_accuracy": float(accuracy.result())}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--train-steps", type=int, default=200)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--global-batch", type=int, default=48)
    args = parser.parse_args()

    strategy = mpi_strategy.MPIStrategy()
    with strategy.scope():
        model, loss_fn, optimizer = model_fn()
        optimizer.build(model.trainable_variables)
    start, last_loss = train(strategy, model, loss_fn, optimizer, args)
    results = evaluate(strategy, model, loss_fn, args.global_batch)
    export_dir = os.path.join(args.model_dir, "export")
    model.export(export_dir, verbose=False)
    if strategy.extended.should_checkpoint:
        print(
            json.dumps(
                {
                    "ranks": strategy.cluster_resolver.num_workers,
                    "resumed_from_step": start,
                    "step": args.train_steps,
                    "last_train_loss": last_loss,
                    **results,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
