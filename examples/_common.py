"""What the four workloads of the seed paper (mnist_lenet, cifar10_cnn,
higgs_dnn, adult_wide_deep) share: their command line and a throughput callback.
"""

import argparse
import time

import keras


def argument_parser(doc, *, epochs, batch_per_replica, examples):
    """The options every workload has; the example may add its own."""
    parser = argparse.ArgumentParser(
        description=doc.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--data",
        metavar="PATH",
        help="the real dataset (see the module docstring); "
        "default: synthetic data of the same shape and type",
    )
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument(
        "--batch-per-replica",
        type=int,
        default=batch_per_replica,
        help="global batch = this x strategy.num_replicas_in_sync",
    )
    parser.add_argument(
        "--examples",
        type=int,
        default=examples,
        help="number of synthetic training examples (ignored with --data)",
    )
    parser.add_argument(
        "--steps-per-epoch",
        type=int,
        default=None,
        help="stop each epoch after this many steps (for smoke tests); "
        "default: one pass over the data",
    )
    return parser


class Throughput(keras.callbacks.Callback):
    """Prints on rank 0, for each epoch, one line with its loss, accuracy and throughput.

    Throughput is ``steps x global_batch`` samples over the time from the start
    of the epoch to the end of its last training step (validation excluded),
    for all ranks together and per rank. Every step must see a full global
    batch (batch with ``drop_remainder=True``), else the count is too high.
    """

    def __init__(self, strategy, global_batch):
        super().__init__()
        self.global_batch = global_batch
        self.ranks = strategy.cluster_resolver.num_workers
        self.chief = strategy.cluster_resolver.task_id == 0
        self.pending = None

    def on_epoch_begin(self, epoch, logs=None):
        self._print_pending()
        self.start = self.end = time.perf_counter()
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps = batch + 1  # `batch` is the index of the step within the epoch
        self.end = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        rate = self.steps * self.global_batch / max(self.end - self.start, 1e-9)
        # The logs hold global values, the same on every rank. Keras' progress
        # bar ends its line after this callback, so the line waits until then.
        self.pending = (
            f"epoch {epoch + 1}/{self.params['epochs']}: loss {logs['loss']:.4f}  "
            f"accuracy {logs['accuracy']:.4f}  throughput {rate:,.0f} samples/s "
            f"({rate / self.ranks:,.0f} per rank, {self.ranks} ranks)"
        )

    def on_train_end(self, logs=None):
        self._print_pending()

    def _print_pending(self):
        if self.pending and self.chief:
            print(self.pending, flush=True)
        self.pending = None
