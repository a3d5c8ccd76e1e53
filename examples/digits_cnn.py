"""Real data, real accuracy: Keras ``fit`` of a small CNN on 8x8 handwritten digits.

    mpiexec -n 3 python examples/digits_cnn.py

The digits are the ones custom_loop.py learns (shipped in examples/data/, no
download; the same 360 held-out test images). The global batch is the same at
every world size, so 1, 2 or 3 ranks reach the same test accuracy. Rank 0
prints one JSON line with the result.
"""

import argparse
import json

import keras
import numpy as np

import mpi_strategy
from custom_loop import load_digits


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=90, help="global batch size")
    args = parser.parse_args()

    (x_train, y_train), (x_test, y_test) = load_digits()
    x_train, x_test = (np.reshape(x, (-1, 8, 8, 1)) for x in (x_train, x_test))

    keras.utils.set_random_seed(0)  # same initial weights and shuffling on every rank
    strategy = mpi_strategy.MPIStrategy()
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((8, 8, 1)),
                keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
                keras.layers.Flatten(),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(2e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=0)
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=0)
    if strategy.extended.should_checkpoint:
        print(
            json.dumps(
                {
                    "ranks": strategy.cluster_resolver.num_workers,
                    "test_loss": loss,
                    "test_accuracy": accuracy,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
