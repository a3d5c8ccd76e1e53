"""Elastic training with Keras ``fit``: a lost rank does not end the job.

    mpirun --with-ft ulfm -n 3 python examples/elastic_keras_fit.py

(Open MPI 5 with User-Level Failure Mitigation; kill any rank with SIGKILL
while it trains.) ``fit`` runs inside ``mpi_strategy.elastic.run``; the
``KerasCallback`` commits at every epoch's end, and after a recovery ``fit``
goes on from the last epoch every survivor finished, with the same global
batches. Rank 0 of the survivors prints, as its last line, one JSON object:
ranks at start and at end, epochs and steps done, final loss.
``--kill R@B`` (repeatable) makes rank R of the launch kill itself with
SIGKILL after global batch B of the run, to try it (``--pause-ms`` slows each
batch, to kill one from outside). With ``--replace-lost``,
new processes are started for lost ranks and join at the end of an epoch.
"""

import argparse
import json
import os
import signal
import time

import numpy as np
import tensorflow as tf
from mpi4py import MPI

import mpi_strategy


class KillAt(tf.keras.callbacks.Callback):
    """SIGKILLs this process after the given batches (counted over the whole run)."""

    def __init__(self, batches, steps_per_epoch):
        super().__init__()
        self._batches, self._per_epoch, self._epoch = set(batches), steps_per_epoch, 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self._epoch * self._per_epoch + batch + 1 in self._batches:
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--examples", type=int, default=960)
    parser.add_argument("--global-batch", type=int, default=96)
    parser.add_argument("--kill", action="append", default=[], metavar="RANK@BATCH")
    parser.add_argument(
        "--pause-ms",
        type=float,
        default=0,
        help="sleep after each batch (a slower model: time to kill a rank from outside)",
    )
    parser.add_argument(
        "--replace-lost",
        action="store_true",
        help="start new processes for lost ranks: they join at an epoch's end",
    )
    args = parser.parse_args()
    my_kills = [
        int(b)
        for r, b in (k.split("@") for k in args.kill)
        if int(r) == MPI.COMM_WORLD.Get_rank() and not mpi_strategy.elastic.is_replacement()
    ]

    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.examples, 20)).astype(np.float32)
    y = (x[:, :5].sum(axis=1) > 0).astype(np.int64)

    strategy = mpi_strategy.MPIStrategy()
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
        model.compile(
            optimizer=tf.keras.optimizers.SGD(0.05, momentum=0.9),
            loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    state = mpi_strategy.elastic.State(model, model.optimizer, epoch=0)
    steps_per_epoch = args.examples // args.global_batch

    @mpi_strategy.elastic.run(strategy, state, replace_lost=args.replace_lost)
    def train(state):
        return model.fit(
            x,
            y,
            batch_size=args.global_batch,
            epochs=args.epochs,
            initial_epoch=state.epoch,
            shuffle=False,
            verbose=2,
            callbacks=[
                mpi_strategy.elastic.KerasCallback(state),
                KillAt(my_kills, steps_per_epoch),
                tf.keras.callbacks.LambdaCallback(
                    on_train_batch_end=lambda batch, logs: time.sleep(args.pause_ms / 1000)
                ),
            ],
        ).history

    history = train()
    if strategy.extended.rank == 0:
        print(
            json.dumps(
                {
                    "ranks_at_start": ranks_at_start,
                    "ranks_at_end": strategy.extended.comm.Get_size(),
                    "epochs": state.epoch,
                    "steps": state.epoch * steps_per_epoch,
                    "final_loss": float(history["loss"][-1]),
                    "weights_sum": float(sum(np.sum(w) for w in model.get_weights())),
                    "recoveries": mpi_strategy.elastic.recoveries,
                    "replacements": mpi_strategy.elastic.replacements,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
