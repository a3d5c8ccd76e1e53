"""UCI Adult (census income) with a wide & deep model (the seed paper's Adult workload).

    mpiexec -n 2 python examples/adult_wide_deep.py              # synthetic, no download
    mpiexec -n 4 python examples/adult_wide_deep.py --data adult.data --epochs 10

Trained with Keras fit to predict whether income is >50K from 6 numeric and
8 categorical columns. The categorical values (and one crossed column,
education x occupation) are hashed to ids and looked up in embedding tables:
a 1-wide table per column for the wide (linear) part, an 8-wide one per
column for the deep part, whose embeddings join the numeric columns in two
hidden layers. Embedding lookups have sparse gradients: they reach the
strategy as ``tf.IndexedSlices`` and are all-gathered across ranks, not
densified. Batch 128 per replica, so the global batch is
128 x strategy.num_replicas_in_sync.

Input is CSV as in UCI's adult.data: 15 comma-separated columns, no header,
``?`` for a missing value, the label ``>50K`` or ``<=50K`` last (adult.test's
``>50K.``, header line and blank lines are accepted too). By default the lines
are 8,192 synthetic ones, the same on every rank; with ``--data PATH`` they are
read from PATH (adult.data: 32,561 lines, one full pass per epoch). Each rank
parses only its own share of the lines (``distribute_datasets_from_function``).
Rank 0 prints the progress bar and, after each epoch, loss, accuracy and
throughput.
"""

import keras
import numpy as np
import tensorflow as tf

import mpi_strategy
from _common import Throughput, argument_parser

COLUMNS = [
    "age",
    "workclass",
    "fnlwgt",
    "education",
    "education_num",
    "marital_status",
    "occupation",
    "relationship",
    "race",
    "sex",
    "capital_gain",
    "capital_loss",
    "hours_per_week",
    "native_country",
    "income",
]
NUMERIC = ["age", "fnlwgt", "education_num", "capital_gain", "capital_loss", "hours_per_week"]
# Hash buckets per categorical column (a few times its number of values).
CATEGORICAL = {
    "workclass": 32,
    "education": 64,
    "marital_status": 32,
    "occupation": 64,
    "relationship": 32,
    "race": 16,
    "sex": 8,
    "native_country": 128,
}
# A wide-only column: the pair of values, in 1024 buckets.
CROSSED, CROSSED_BUCKETS = ("education", "occupation"), 1024
CROSSED_NAME = "education_x_occupation"
DEEP_EMBEDDING = 8
SHUFFLE_BUFFER = 50_000  # lines

# Values seen in adult.data (the synthetic data draws from these).
_VALUES = {
    "workclass": [
        "Private",
        "Self-emp-not-inc",
        "Self-emp-inc",
        "Federal-gov",
        "Local-gov",
        "State-gov",
        "Without-pay",
        "Never-worked",
    ],
    "education": [
        "Bachelors",
        "Some-college",
        "11th",
        "HS-grad",
        "Prof-school",
        "Assoc-acdm",
        "Assoc-voc",
        "9th",
        "7th-8th",
        "12th",
        "Masters",
        "1st-4th",
        "10th",
        "Doctorate",
        "5th-6th",
        "Preschool",
    ],
    "marital_status": [
        "Married-civ-spouse",
        "Divorced",
        "Never-married",
        "Separated",
        "Widowed",
        "Married-spouse-absent",
        "Married-AF-spouse",
    ],
    "occupation": [
        "Tech-support",
        "Craft-repair",
        "Other-service",
        "Sales",
        "Exec-managerial",
        "Prof-specialty",
        "Handlers-cleaners",
        "Machine-op-inspct",
        "Adm-clerical",
        "Farming-fishing",
        "Transport-moving",
        "Priv-house-serv",
        "Protective-serv",
        "Armed-Forces",
    ],
    "relationship": [
        "Wife",
        "Own-child",
        "Husband",
        "Not-in-family",
        "Other-relative",
        "Unmarried",
    ],
    "race": ["White", "Asian-Pac-Islander", "Amer-Indian-Eskimo", "Other", "Black"],
    "sex": ["Female", "Male"],
    "native_country": [
        "United-States",
        "Mexico",
        "Philippines",
        "Germany",
        "Canada",
        "India",
        "England",
        "Cuba",
        "Jamaica",
        "South",
        "China",
        "Italy",
        "Puerto-Rico",
    ],
}


def synthetic_adult_lines(n, seed=0):
    """``n`` deterministic lines in adult.data's format (with its spaces after
    commas and some ``?``); the label depends on the columns, with noise."""
    rng = np.random.default_rng(seed)
    effect = np.random.default_rng(1)
    score = rng.normal(-1.2, 0.7, n)
    columns = {}
    for name, values in _VALUES.items():
        idx = rng.integers(0, len(values), n)
        score += effect.normal(0, 0.8, len(values))[idx]
        columns[name] = np.array(values, dtype=object)[idx]
        if name in ("workclass", "occupation", "native_country"):  # missing in the real data
            columns[name][rng.random(n) < 0.05] = "?"
    columns["age"] = rng.integers(17, 91, n)
    columns["fnlwgt"] = rng.integers(12_000, 1_500_000, n)
    columns["education_num"] = rng.integers(1, 17, n)
    columns["capital_gain"] = np.where(rng.random(n) < 0.1, rng.integers(1, 99_999, n), 0)
    columns["capital_loss"] = np.where(rng.random(n) < 0.05, rng.integers(1, 4_356, n), 0)
    columns["hours_per_week"] = rng.integers(1, 100, n)
    score += (columns["age"] - 38) / 15 + (columns["hours_per_week"] - 40) / 15
    score += 2.0 * (columns["capital_gain"] > 5000)
    columns["income"] = np.where(score > 0, ">50K", "<=50K")
    return [", ".join(str(columns[c][i]) for c in COLUMNS) for i in range(n)]


def adult_lines(path):
    """The data lines of an Adult CSV file: blank lines and adult.test's
    ``|1x3 Cross validator`` header line are left out."""
    if not tf.io.gfile.exists(path):
        raise FileNotFoundError(f"adult_wide_deep: {path} not found")
    lines = tf.data.TextLineDataset(path)
    return lines.filter(
        lambda line: tf.logical_and(
            tf.strings.length(tf.strings.strip(line)) > 0,
            tf.logical_not(tf.strings.regex_full_match(line, r"\|.*")),
        )
    )


def _ids(values, buckets):
    # "?" (missing) gets id 0; other values hash into 1 .. buckets - 1.
    hashed = 1 + tf.strings.to_hash_bucket_fast(values, buckets - 1)
    return tf.where(tf.equal(values, "?"), tf.zeros_like(hashed), hashed)


def parse_adult(lines):
    """A batch of CSV lines -> (dict of model inputs, float32 labels, 1 for >50K)."""
    fields = tf.io.decode_csv(lines, record_defaults=[[""]] * len(COLUMNS))
    fields = dict(zip(COLUMNS, (tf.strings.strip(f) for f in fields)))
    # Numeric columns span 1 to 1e6: log1p brings them to one scale.
    numeric = tf.stack([tf.strings.to_number(fields[c]) for c in NUMERIC], axis=1)
    inputs = {"numeric": tf.math.log1p(numeric)}
    for name, buckets in CATEGORICAL.items():
        inputs[name] = _ids(fields[name], buckets)
    inputs[CROSSED_NAME] = _ids(
        tf.strings.join([fields[c] for c in CROSSED], separator=" x "), CROSSED_BUCKETS
    )

    label = tf.strings.regex_replace(fields["income"], r"\.$", "")  # adult.test: ">50K."
    positive = tf.equal(label, ">50K")
    known = positive | tf.equal(label, "<=50K")
    check = tf.debugging.Assert(
        tf.reduce_all(known),
        [
            "adult_wide_deep: the last column must be >50K or <=50K, got",
            tf.boolean_mask(label, ~known),
        ],
    )
    with tf.control_dependencies([check]):
        return inputs, tf.cast(positive, tf.float32)


def distributed_dataset(strategy, lines, global_batch, repeat=False):
    """``lines`` (a dataset of CSV lines, the same on every rank) as a
    distributed dataset: each rank reads all lines but parses only its share."""

    def dataset_fn(context):
        batch = context.get_per_replica_batch_size(global_batch)
        shard = lines.shard(context.num_input_pipelines, context.input_pipeline_id)
        shard = shard.shuffle(SHUFFLE_BUFFER, seed=context.input_pipeline_id)
        if repeat:
            shard = shard.repeat()
        return (
            shard.batch(batch, drop_remainder=True)
            .map(parse_adult, num_parallel_calls=tf.data.AUTOTUNE)
            .prefetch(tf.data.AUTOTUNE)
        )

    return strategy.distribute_datasets_from_function(dataset_fn)


def wide_and_deep():
    numeric = keras.Input((len(NUMERIC),), name="numeric")
    categorical = {
        name: (keras.Input((), dtype="int64", name=name), buckets)
        for name, buckets in CATEGORICAL.items()
    }
    crossed = keras.Input((), dtype="int64", name=CROSSED_NAME)

    # Wide: a linear model of the one-hot columns, i.e. a 1-wide embedding each.
    wide = [
        keras.layers.Embedding(buckets, 1, name=f"wide_{name}")(ids)
        for name, (ids, buckets) in categorical.items()
    ]
    wide.append(keras.layers.Embedding(CROSSED_BUCKETS, 1, name=f"wide_{CROSSED_NAME}")(crossed))
    wide = keras.layers.Add()(wide)

    deep = [
        keras.layers.Embedding(buckets, DEEP_EMBEDDING, name=f"deep_{name}")(ids)
        for name, (ids, buckets) in categorical.items()
    ]
    deep = keras.layers.Concatenate()([numeric, *deep])
    deep = keras.layers.Dense(64, activation="relu")(deep)
    deep = keras.layers.Dense(32, activation="relu")(deep)
    deep = keras.layers.Dense(1)(deep)

    probability = keras.layers.Activation("sigmoid")(keras.layers.Add()([wide, deep]))
    inputs = {"numeric": numeric, CROSSED_NAME: crossed}
    inputs.update({name: ids for name, (ids, _) in categorical.items()})
    return keras.Model(inputs, probability, name="wide_and_deep")


def main():
    args = argument_parser(__doc__, epochs=2, batch_per_replica=128, examples=8192).parse_args()
    keras.utils.set_random_seed(1)
    strategy = mpi_strategy.MPIStrategy()
    global_batch = args.batch_per_replica * strategy.num_replicas_in_sync

    if args.data:
        lines = adult_lines(args.data)
    else:
        lines = tf.data.Dataset.from_tensor_slices(synthetic_adult_lines(args.examples))
    dataset = distributed_dataset(strategy, lines, global_batch, repeat=bool(args.steps_per_epoch))

    with strategy.scope():
        model = wide_and_deep()
        model.compile(
            optimizer=keras.optimizers.Adam(3e-3), loss="binary_crossentropy", metrics=["accuracy"]
        )
    model.fit(
        dataset,
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        callbacks=[Throughput(strategy, global_batch)],
    )


if __name__ == "__main__":
    main()
