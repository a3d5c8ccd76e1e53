"""Data-parallel Keras training with model.fit: the template to copy.

    mpiexec -n 2 python examples/keras_fit.py

Synthetic MNIST-shaped data (no download). Progress, checkpoints and the saved
model come from rank 0; every rank gets the same history and predictions.
"""

import argparse
import os
import tempfile

import keras
import numpy as np

import mpi_strategy


def synthetic_mnist(n, seed):
    rng = np.random.default_rng(seed)
    templates = np.random.default_rng(0).random((10, 784)).astype(np.float32)
    labels = rng.integers(0, 10, n)
    images = templates[labels] + rng.standard_normal((n, 784)).astype(np.float32)
    return images, labels


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256, help="global batch size")
    parser.add_argument("--output", default=os.path.join(tempfile.gettempdir(), "keras_fit"))
    args = parser.parse_args()

    keras.utils.set_random_seed(1)  # the same shuffling on every rank
    strategy = mpi_strategy.MPIStrategy()
    x, y = synthetic_mnist(8192, seed=1)
    x_test, y_test = synthetic_mnist(1024, seed=2)

    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((784,)),
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )

    model.fit(
        x,
        y,
        batch_size=args.batch_size,
        epochs=args.epochs,
        validation_data=(x_test, y_test),
        callbacks=[keras.callbacks.BackupAndRestore(os.path.join(args.output, "backup"))],
    )
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=0)
    predictions = model.predict(x_test, batch_size=args.batch_size, verbose=0)
    model.save(os.path.join(args.output, "model.keras"))  # on every rank, written once
    if strategy.extended.should_checkpoint:
        print(
            f"test loss {loss:.4f}  accuracy {accuracy:.4f}  "
            f"predictions {predictions.shape}  saved {os.path.join(args.output, 'model.keras')}"
        )


if __name__ == "__main__":
    main()
