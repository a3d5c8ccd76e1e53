"""Real data, real accuracy: a small CNN on scikit-learn's 8x8 handwritten digits.

    mpiexec -n 3 python examples/digits_cnn.py

The dataset ships inside scikit-learn (no download). The global batch is the
same at every world size, so 1, 2 or 3 ranks reach the same test accuracy.
Rank 0 prints one JSON line with the result.
"""

import argparse
import json

import keras
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import mpi_strategy


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=90, help="global batch size")
    args = parser.parse_args()

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]  # 8x8x1 in [0, 1]
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target, test_size=0.2, random_state=0, stratify=digits.target
    )

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
