"""The benchmark workloads as tf.keras models, with synthetic batches.

Each entry builds the model (call it inside ``strategy.scope()``) and makes a
per-replica batch ``(x, y)`` of fixed random data: the benchmarks time the
step, not the input pipeline.

- ``mlp``: 784-1024-1024-10 (the issue's reference step);
- ``cnn``: CIFAR-10-sized, conv 32/32/64 + dense 64 (also the paper's CIFAR-10 workload);
- ``embedding``: a 100k x 64 embedding averaged over a bag of ids per example,
  then dense 64 -> 10; its embedding gradient is a ``tf.IndexedSlices``;
- ``widedeep``: the paper's Adult workload in the shape of
  ``examples/adult_wide_deep.py``: 9 hashed categorical columns, each with a
  wide (1-wide) and a deep (8-wide) embedding table, into dense 64-32-2: 18
  tables, 18 ``tf.IndexedSlices`` gradients per step;
- ``lenet3``: the paper's MNIST LeNet-3 (conv 20/50, fc 500);
- ``higgs``: a DNN on Higgs' 28 features (5 x 300 tanh, the usual Higgs DNN; assumed);
- ``higgs_small``: the latency-bound Higgs-sized DNN of the performance issue
  (28 -> 3 x 128 relu -> 2): a step is about a millisecond, so fixed per-step
  costs decide the speedup.
"""

import numpy as np
import tensorflow as tf

EMBEDDING_VOCAB = 100_000
EMBEDDING_BAG = 16  # ids per example


def _mlp():
    return tf.keras.Sequential(
        [
            tf.keras.Input((784,)),
            tf.keras.layers.Dense(1024, activation="relu"),
            tf.keras.layers.Dense(1024, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )


def _cnn():
    return tf.keras.Sequential(
        [
            tf.keras.Input((32, 32, 3)),
            tf.keras.layers.Conv2D(32, 3, activation="relu"),
            tf.keras.layers.Conv2D(32, 3, activation="relu"),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Conv2D(64, 3, activation="relu"),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(64, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )


def _embedding():
    return tf.keras.Sequential(
        [
            tf.keras.Input((EMBEDDING_BAG,), dtype="int32"),
            tf.keras.layers.Embedding(EMBEDDING_VOCAB, 64),
            tf.keras.layers.GlobalAveragePooling1D(),
            tf.keras.layers.Dense(64, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )


WIDEDEEP_BUCKETS = [32, 64, 32, 64, 16, 16, 8, 64, 256]  # per categorical column


def _widedeep():
    ids = tf.keras.Input((len(WIDEDEEP_BUCKETS),), dtype="int32")
    wide, deep = [], []
    for column, buckets in enumerate(WIDEDEEP_BUCKETS):
        one = ids[:, column]
        wide.append(tf.keras.layers.Embedding(buckets, 1)(one))
        deep.append(tf.keras.layers.Embedding(buckets, 8)(one))
    hidden = tf.keras.layers.Dense(64, activation="relu")(tf.keras.layers.Concatenate()(deep))
    hidden = tf.keras.layers.Dense(32, activation="relu")(hidden)
    logits = tf.keras.layers.Add()(
        [
            tf.keras.layers.Dense(2)(hidden),
            tf.keras.layers.Dense(2)(tf.keras.layers.Concatenate()(wide)),
        ]
    )
    return tf.keras.Model(ids, logits)


def _lenet3():
    return tf.keras.Sequential(
        [
            tf.keras.Input((28, 28, 1)),
            tf.keras.layers.Conv2D(20, 5, activation="relu"),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Conv2D(50, 5, activation="relu"),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(500, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )


def _higgs():
    return tf.keras.Sequential(
        [tf.keras.Input((28,))]
        + [tf.keras.layers.Dense(300, activation="tanh") for _ in range(5)]
        + [tf.keras.layers.Dense(2)]
    )


def _higgs_small():
    return tf.keras.Sequential(
        [tf.keras.Input((28,))]
        + [tf.keras.layers.Dense(128, activation="relu") for _ in range(3)]
        + [tf.keras.layers.Dense(2)]
    )


BUILDERS = {
    "mlp": _mlp,
    "cnn": _cnn,
    "embedding": _embedding,
    "widedeep": _widedeep,
    "lenet3": _lenet3,
    "higgs": _higgs,
    "higgs_small": _higgs_small,
}
CLASSES = {
    "mlp": 10,
    "cnn": 10,
    "embedding": 10,
    "widedeep": 2,
    "lenet3": 10,
    "higgs": 2,
    "higgs_small": 2,
}


def build(name):
    """A fresh tf.keras model for workload ``name`` (one of ``BUILDERS``)."""
    if name not in BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(BUILDERS)}")
    return BUILDERS[name]()


def batch(name, size, seed=0):
    """A synthetic ``(x, y)`` batch of ``size`` examples for workload ``name``."""
    model_input = build_input_shape(name)
    rng = np.random.default_rng(seed)
    if name == "embedding":
        x = rng.integers(0, EMBEDDING_VOCAB, (size, *model_input), dtype=np.int32)
    elif name == "widedeep":
        x = rng.integers(0, WIDEDEEP_BUCKETS, (size, *model_input), dtype=np.int32)
    else:
        x = rng.random((size, *model_input), np.float32)
    y = rng.integers(0, CLASSES[name], size)
    return tf.constant(x), tf.constant(y)


def build_input_shape(name):
    return {
        "mlp": (784,),
        "cnn": (32, 32, 3),
        "embedding": (EMBEDDING_BAG,),
        "widedeep": (len(WIDEDEEP_BUCKETS),),
        "lenet3": (28, 28, 1),
        "higgs": (28,),
        "higgs_small": (28,),
    }[name]


def parameter_count(name):
    """Trainable parameters of the real Keras model (what one all-reduce carries)."""
    return int(sum(np.prod(v.shape) for v in build(name).trainable_variables))


def gradient_shapes(name):
    return [tuple(v.shape) for v in build(name).trainable_variables]
