"""Run by tests/launchers/features/elastic/test_elastic.py under ULFM: Horovod's elastic API
(``hvd.elastic.run``, ``TensorFlowKerasState``) with ranks SIGKILLed mid-training.

Every rank trains the same model on the same batch with Horovod's
``DistributedGradientTape`` (so the averaged gradient does not depend on the
number of ranks) and commits every ``--commit-every`` steps. ``--kill R@K``
(repeatable): rank R of the launch kills itself at the start of step K, when
the others are already in that step's collectives; they restore the last
commit, continue on fewer ranks and finish. Rank 0 at the end prints one JSON
line: ranks at start and end, steps, ``ranks_summed`` (each step adds the
number of ranks that did it: the steps undone by the rollback do not count),
the sizes the reset callbacks saw, and the weights' sum, with the sum of a
run of the same steps on one process without Horovod (``reference``).
``--traced-before-run``: the step function is built (and traced) before
``hvd.elastic.run``, as Horovod's examples do; after a loss it holds the old
communicator, and the survivors end with status 1 saying so.
"""

import argparse
import json
import os
import signal

import numpy as np
import tensorflow as tf

import mpi_strategy.horovod.tensorflow as hvd


def build():
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
    optimizer = tf.keras.optimizers.SGD(0.05, momentum=0.9)
    return model, optimizer


def batch():
    x = np.random.default_rng(1).standard_normal((16, 4)).astype(np.float32)
    return x, x.sum(axis=1, keepdims=True) * 0.5


def loss_of(model, x, y):
    return tf.reduce_mean((model(x) - y) ** 2)


def weights_sum(model):
    return float(sum(float(tf.reduce_sum(v)) for v in model.trainable_variables))


def reference(steps):
    """The same steps on one process, without Horovod."""
    model, optimizer = build()
    x, y = batch()
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = loss_of(model, x, y)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return weights_sum(model)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--commit-every", type=int, default=2)
    parser.add_argument("--kill", action="append", default=[], metavar="RANK@STEP")
    parser.add_argument(
        "--traced-before-run",
        action="store_true",
        help="build the step function before hvd.elastic.run (the survivors must say why not)",
    )
    args = parser.parse_args()
    hvd.init()
    start_rank, start_size = hvd.rank(), hvd.size()
    my_kill_steps = {int(s) for r, s in (k.split("@") for k in args.kill) if int(r) == start_rank}
    model, optimizer = build()
    x, y = batch()
    state = hvd.elastic.TensorFlowKerasState(model, optimizer, step=0, ranks_summed=0)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    def make_step():
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = loss_of(model, x, y)
            grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return hvd.allreduce(tf.constant(1), op=hvd.Sum)  # the ranks in this step

        return step

    traced_before = make_step() if args.traced_before_run else None

    @hvd.elastic.run
    def train(state):
        step = traced_before or make_step()  # built here: traced again for the survivors
        while state.step < args.steps:
            if state.step in my_kill_steps:
                os.kill(os.getpid(), signal.SIGKILL)
            state.ranks_summed += int(step())
            state.step += 1
            if state.step % args.commit_every == 0:
                state.commit()

    train(state)
    if hvd.rank() == 0:
        result = {
            "ranks_at_start": start_size,
            "ranks_at_end": hvd.size(),
            "steps": state.step,
            "ranks_summed": state.ranks_summed,
            "resets": resets,
            "weights_sum": weights_sum(model),
            "reference": reference(args.steps),
        }
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
