"""Run by tests/launchers/features/elastic/test_elastic.py under ULFM: rank
``--rank`` (-1: every rank) raises an uncaught error of its own at step
``--step``; the others must not wait for it. ``--elastic``: the loop runs
inside elastic.run (the others go on without the rank), else the job ends with
a non-zero status (so does it, at any rate, when every rank raises).
``--killed-before-strategy``: the rank is SIGKILLed before MPIStrategy() (the
job ends, status 1; the others print EXIT_HANDLERS_RAN if they leave through
Python's exit handlers, after which MPI_Finalize may wait for the dead rank).
Rank 0 of the end prints one JSON line."""

import argparse
import atexit
import json
import os
import signal

import tensorflow as tf

import mpi_strategy


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, default=2)
    parser.add_argument("--step", type=int, default=3)
    parser.add_argument("--elastic", action="store_true")
    parser.add_argument("--killed-before-strategy", action="store_true")
    args = parser.parse_args()
    if args.killed_before_strategy:
        if int(os.environ["OMPI_COMM_WORLD_RANK"]) == args.rank:
            os.kill(os.getpid(), signal.SIGKILL)
        atexit.register(print, "EXIT_HANDLERS_RAN", flush=True)
    strategy = mpi_strategy.MPIStrategy()
    start_rank = strategy.extended.rank
    with strategy.scope():
        counter = tf.Variable(0.0)
    state = mpi_strategy.elastic.State(counter, step=0)

    def train(state):
        while state.step < 10:
            if state.step == args.step and args.rank in (start_rank, -1):
                raise ValueError(f"an error of rank {start_rank} alone")
            total = strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
            counter.assign_add(total)
            state.step += 1
            state.commit()

    if args.elastic:
        mpi_strategy.elastic.run(strategy, state)(train)()
    else:
        train(state)
    if strategy.extended.rank == 0:
        print(
            json.dumps(
                {
                    "ranks_at_end": strategy.extended.comm.Get_size(),
                    "steps": state.step,
                    "counter": float(counter.numpy()),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
