"""Run by tests/launchers/features/elastic/test_elastic.py under ULFM: an
``elastic.run`` program whose step function is built (and traced) before
``elastic.run``, so that after a recovery it still holds the communicator of
before it. ``--kill R@K``: rank R of the launch kills itself at the start of
step K. The survivors must end with status 1, each saying why
(``mpi_strategy.elastic.StaleCollectiveError``), after one recovery: not
recover again and again with no rank lost.
"""

import argparse
import os
import signal

import tensorflow as tf

import mpi_strategy


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill", action="append", default=[], metavar="RANK@STEP")
    args = parser.parse_args()
    strategy = mpi_strategy.MPIStrategy()
    rank = strategy.extended.rank
    my_kill_steps = {int(s) for r, s in (k.split("@") for k in args.kill) if int(r) == rank}
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
        optimizer = tf.keras.optimizers.SGD(0.05)
    state = mpi_strategy.elastic.State(model, optimizer, step=0)

    @tf.function  # built before elastic.run: keeps the collectives of its trace
    def ranks_in_step():
        return strategy.reduce("SUM", strategy.run(lambda: tf.constant(1)), axis=None)

    @mpi_strategy.elastic.run(strategy, state)
    def train(state):
        while state.step < args.steps:
            if state.step in my_kill_steps:
                os.kill(os.getpid(), signal.SIGKILL)
            ranks_in_step()
            state.step += 1
            if state.step % 2 == 0:
                state.commit()

    train()


if __name__ == "__main__":
    main()
