"""HIGGS with a fully connected network (the seed paper's Higgs workload), trained with Keras fit.

    mpiexec -n 2 python examples/higgs_dnn.py                    # synthetic, no download
    mpiexec -n 4 python examples/higgs_dnn.py --data HIGGS.csv.gz --epochs 5

The network: the 28 features, three hidden layers of 300 ReLU units, a
sigmoid output (signal or background); batch 128 per replica, so the global
batch is 128 x strategy.num_replicas_in_sync.

Input is CSV as in UCI's HIGGS.csv: 29 comma-separated numbers per line, the
label (1 signal, 0 background) first, no header. By default the lines are
16,384 synthetic ones, the same on every rank; with ``--data PATH`` they are
read from PATH (HIGGS.csv, or HIGGS.csv.gz as downloaded: all 11 million
lines, one full pass per epoch). Each rank parses only its own share of the
lines (``distribute_datasets_from_function``), so parsing scales with the
ranks. Rank 0 prints the progress bar and, after each epoch, loss, accuracy
and throughput.
"""

import io

import keras
import numpy as np
import tensorflow as tf

import mpi_strategy
from _common import Throughput, argument_parser

FEATURES = 28
SHUFFLE_BUFFER = 100_000  # lines


def synthetic_higgs_lines(n, seed=0):
    """``n`` deterministic lines in HIGGS.csv's format; the label depends on the
    features (not linearly) with some noise, so it can be learnt, not perfectly."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, FEATURES))
    x[:, :21:3] = np.abs(x[:, :21:3]) + 0.5  # momenta: positive, like the real low-level ones
    weights = np.random.default_rng(1).standard_normal(FEATURES)
    score = x @ weights / np.sqrt(FEATURES) + x[:, 0] * x[:, 3] - 1.0 + rng.normal(0, 0.5, n)
    table = np.column_stack([score > 0, x])
    text = io.StringIO()
    np.savetxt(text, table, fmt="%.18e", delimiter=",")
    return text.getvalue().splitlines()


def parse_higgs(lines):
    """A batch of CSV lines -> (float32 [batch, 28] features, float32 [batch] labels)."""
    columns = tf.io.decode_csv(lines, record_defaults=[[0.0]] * (1 + FEATURES))
    return tf.stack(columns[1:], axis=1), columns[0]


def higgs_lines(path):
    """The lines of a HIGGS CSV file (gzipped if its name ends in .gz)."""
    if not tf.io.gfile.exists(path):
        raise FileNotFoundError(f"higgs_dnn: {path} not found")
    return tf.data.TextLineDataset(path, compression_type="GZIP" if path.endswith(".gz") else "")


def distributed_dataset(strategy, lines, global_batch, repeat=False):
    """``lines`` (a dataset of CSV lines, the same on every rank) as a
    distributed dataset: each rank reads all lines but parses only its share."""

    def dataset_fn(context):
        batch = context.get_per_replica_batch_size(global_batch)
        shard = lines.shard(context.num_input_pipelines, context.input_pipeline_id)
        shard = shard.shuffle(SHUFFLE_BUFFER, seed=context.input_pipeline_id)
        if repeat:
            shard = shard.repeat()
        # Batch first: decode_csv parses a whole batch at once.
        return (
            shard.batch(batch, drop_remainder=True)
            .map(parse_higgs, num_parallel_calls=tf.data.AUTOTUNE)
            .prefetch(tf.data.AUTOTUNE)
        )

    return strategy.distribute_datasets_from_function(dataset_fn)


def higgs_dnn():
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(300, activation="relu"),
            keras.layers.Dense(300, activation="relu"),
            keras.layers.Dense(300, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ],
        name="higgs_dnn",
    )


def main():
    args = argument_parser(__doc__, epochs=2, batch_per_replica=128, examples=16384).parse_args()
    keras.utils.set_random_seed(1)
    strategy = mpi_strategy.MPIStrategy()
    global_batch = args.batch_per_replica * strategy.num_replicas_in_sync

    if args.data:
        lines = higgs_lines(args.data)
    else:
        lines = tf.data.Dataset.from_tensor_slices(synthetic_higgs_lines(args.examples))
    dataset = distributed_dataset(strategy, lines, global_batch, repeat=bool(args.steps_per_epoch))

    with strategy.scope():
        model = higgs_dnn()
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy", metrics=["accuracy"]
        )
    model.fit(
        dataset,
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        callbacks=[Throughput(strategy, global_batch)],
    )


if __name__ == "__main__":
    main()
