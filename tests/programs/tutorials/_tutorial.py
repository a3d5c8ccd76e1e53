"""What the tutorial programs share: their two adaptations, and their report.

Each program in this directory follows one of TensorFlow's distributed-training
tutorials (tensorflow/docs, site/en/tutorials/distribute/ and
site/en/guide/distributed_training.ipynb) call for call, with two changes only:

1. The strategy line: ``strategy = make_strategy()``. With
   ``TUTORIAL_STRATEGY=mpi`` it is ``mpi_strategy.MPIStrategy()`` (launch
   under ``mpiexec -n N``), over ``TUTORIAL_LOCAL_DEVICES`` logical CPUs per
   rank if that is more than 1 (as a rank's share of a node's GPUs would be);
   with ``TUTORIAL_STRATEGY=mirrored`` it is ``tf.distribute.MirroredStrategy``
   over ``TUTORIAL_WORKERS`` (default 2) times as many logical CPUs of this one
   process (which this module creates before anything else uses TensorFlow),
   reducing with ``ReductionToOneDevice``. ``TUTORIAL_SHARD`` is
   MPIStrategy's ``shard=`` argument (the user's other one-line choice).
   The multi-worker tutorials read the cluster from ``TF_CONFIG`` and
   ``strategy.cluster_resolver``; here the cluster is the MPI job (or, under
   MirroredStrategy, the workers its replicas stand for, this process
   being worker 0, the chief), and ``TF_CONFIG`` is the JSON string a launcher
   would have set for it.
2. Local data instead of downloads: ``tfds.load`` and
   ``datasets.mnist`` / ``datasets.fashion_mnist`` return deterministic
   synthetic images of MNIST's shapes and dtypes, few enough that each
   tutorial runs in seconds. ``epochs(n, needed)`` and ``steps(n)`` cut the
   tutorial's epoch and step counts (never the structure of its code).

Every program imports this module first and calls ``begin(keras=...)`` before
anything else (a fresh start: Keras' name counters and every random seed), and
``report(...)`` last: it prints one JSON object of the numbers the tutorial
produced (the same keys under both strategies) as its last line.

``begin`` also names the Keras that the tutorial's calls are written for:
"keras3" (TensorFlow's default ``tf.keras``) for keras.ipynb, whose
``.weights.h5`` checkpoints tf_keras cannot load under a strategy;
"tf_keras" (``TF_USE_LEGACY_KERAS=1``) for the tutorials that call Keras 2
API (``Metric.reset_states``, ``Model.save`` to a SavedModel directory and
``tf.keras.models.load_model`` of one, ``Model.save_spec``); either for the
others. One process has one ``tf.keras``: run_all.py runs each group in its own.
"""

import json
import math
import os
import random
import types

STRATEGY = os.environ.get("TUTORIAL_STRATEGY", "mirrored")
# MPIStrategy's shard= argument (TUTORIAL_SHARD=gradients: ZeRO stage 2).
SHARD = os.environ.get("TUTORIAL_SHARD", "")
if STRATEGY not in ("mpi", "mirrored"):
    raise ValueError(f"TUTORIAL_STRATEGY must be 'mpi' or 'mirrored', not {STRATEGY!r}")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

SEED = 20240611
TRAIN_EXAMPLES = 400  # global batches of 128: 128, 128, 128, 16 (a ragged last one)
TEST_EXAMPLES = 200  # 128, 72

LOCAL_DEVICES = int(os.environ.get("TUTORIAL_LOCAL_DEVICES", "1"))
if STRATEGY == "mpi":
    from mpi4py import MPI

    RANK, WORKERS = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    _COMM = MPI.COMM_WORLD.Dup()  # the report's own messages, apart from the strategy's
    DEVICES = [f"/cpu:{i}" for i in range(LOCAL_DEVICES)]
else:
    RANK, WORKERS = 0, int(os.environ.get("TUTORIAL_WORKERS", "2"))
    _COMM = None
    DEVICES = [f"/cpu:{i}" for i in range(WORKERS * LOCAL_DEVICES)]

# Before TensorFlow's runtime starts: the devices, and one thread per op (the
# ranks share this machine's cores as MirroredStrategy's replicas do).
if len(DEVICES) > 1:
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration() for _ in DEVICES],
    )
tf.config.threading.set_intra_op_parallelism_threads(1)

# The TF_CONFIG a launcher would set for this worker of this cluster.
TF_CONFIG = json.dumps(
    {
        "cluster": {"worker": [f"localhost:{12345 + i}" for i in range(WORKERS)]},
        "task": {"type": "worker", "index": RANK},
    }
)


KERASES = {"keras3": "0", "tf_keras": "1"}  # -> TF_USE_LEGACY_KERAS


def keras_in_use():
    """ "tf_keras" or "keras3": what ``tf.keras`` is in this process."""
    return "tf_keras" if tf.keras.__name__.startswith("tf_keras") else "keras3"


def begin(keras):
    """The start of a tutorial: ``tf.keras`` is ``keras`` ("keras3" or
    "tf_keras"), and Keras' name counters and every seed start afresh, as in a
    new process (the driver runs several tutorials in one)."""
    global LAST_REPORT
    LAST_REPORT = None
    loader = vars(tf).get("keras")
    if loader is not None and not getattr(loader, "_tfll_initialized", True):
        os.environ["TF_USE_LEGACY_KERAS"] = KERASES[keras]  # tf.keras is not loaded yet
    if keras_in_use() != keras:
        raise RuntimeError(
            f"this tutorial is written for {keras}, but tf.keras is "
            f"{keras_in_use()} in this process (TF_USE_LEGACY_KERAS="
            f"{os.environ.get('TF_USE_LEGACY_KERAS')})"
        )
    tf.keras.backend.clear_session()
    random.seed(SEED)
    np.random.seed(SEED)
    tf.random.set_seed(SEED)


def make_strategy():
    """The tutorial's strategy line (see the module docstring)."""
    if STRATEGY == "mpi":
        import mpi_strategy

        return mpi_strategy.MPIStrategy(
            devices=DEVICES if LOCAL_DEVICES > 1 else None, shard=SHARD or None
        )
    # On CPUs MirroredStrategy reduces with TensorFlow's collective ops by
    # default, whose instance keys start at the same number in every
    # MirroredStrategy: the second strategy of a process (the tutorials make
    # several, the driver runs several tutorials) fails with "Shape mismatch in
    # the collective instance 100". ReductionToOneDevice has no such keys.
    strategy = tf.distribute.MirroredStrategy(
        DEVICES, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    # MirroredStrategy has no cluster resolver; the multi-worker tutorials ask
    # theirs which worker this is. This process is worker 0 (the chief) of the
    # cluster whose workers the replicas stand for.
    strategy.extended._cluster_resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(json.loads(TF_CONFIG)["cluster"]), task_type="worker", task_id=0
    )
    return strategy


def epochs(n, needed):
    """The tutorial's ``n`` epochs cut to ``needed``: the fewest that still run
    every branch of its code (e.g. each rate of a schedule, a second checkpoint)."""
    return min(n, needed)


def steps(n):
    """The tutorial's ``n`` steps (per epoch, per loop, between backups) cut to
    a few, in about the tutorial's proportions: 70 -> 3, 30 -> 2, 20 and 10 -> 2."""
    return max(2, math.ceil(n / 25))


# -- local data ------------------------------------------------------------------


def _images(n, seed, kind):
    """``n`` 28x28 uint8 images and uint8 labels in 0..9: a fixed pattern per
    label plus noise, so that a model can learn them."""
    patterns = np.random.default_rng(1000 + kind).uniform(0, 255, (10, 28, 28))
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n)
    images = 0.6 * patterns[labels] + rng.normal(0, 50, (n, 28, 28))
    return np.clip(images, 0, 255).astype(np.uint8), labels.astype(np.uint8)


class _KerasDataset:
    """Like ``tf.keras.datasets.mnist``: ``load_data()`` gives
    ``(x_train, y_train), (x_test, y_test)``, uint8 arrays of shape (N, 28, 28) and (N,)."""

    def __init__(self, kind):
        self._kind = kind

    def load_data(self):
        return (
            _images(TRAIN_EXAMPLES, 2 * self._kind + 1, self._kind),
            _images(TEST_EXAMPLES, 2 * self._kind + 2, self._kind),
        )


datasets = types.SimpleNamespace(mnist=_KerasDataset(0), fashion_mnist=_KerasDataset(1))


class tfds:  # (lower case) stands in for the module tensorflow_datasets
    """``tfds.load(name='mnist', as_supervised=True[, with_info=True])``: a dict
    of ``tf.data.Dataset`` of (uint8 image (28, 28, 1), int64 label), as
    TensorFlow Datasets gives, and an ``info`` with ``splits[...].num_examples``."""

    @staticmethod
    def load(name, with_info=False, as_supervised=False):
        if name != "mnist" or not as_supervised:
            raise ValueError("only tfds.load(name='mnist', as_supervised=True) is stood in for")
        splits = dict(zip(("train", "test"), datasets.mnist.load_data()))
        loaded = {
            split: tf.data.Dataset.from_tensor_slices((x[..., None], y.astype(np.int64)))
            for split, (x, y) in splits.items()
        }
        info = types.SimpleNamespace(
            splits={
                split: types.SimpleNamespace(num_examples=len(x))
                for split, (x, _) in splits.items()
            }
        )
        return (loaded, info) if with_info else loaded


# -- the report --------------------------------------------------------------------

LAST_REPORT = None


def _plain(value):
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, bool, type(None))):
        return value
    if hasattr(value, "numpy"):
        value = value.numpy()
    value = np.asarray(value)
    if value.dtype.kind in "SUO":
        return _plain(value.tolist())
    return value.astype(np.float64).tolist()


def checksum(weights):
    """Per variable, the sum of the absolute values (float64) of its value."""
    return [float(np.sum(np.abs(np.asarray(w, np.float64)))) for w in weights]


def history(h):
    """The per-epoch logs of a ``History`` returned by ``Model.fit``."""
    return {k: [float(x) for x in v] for k, v in sorted(h.history.items())}


def events(logdir):
    """What the event files under ``logdir`` hold, read back as TensorBoard
    would: ``{"<subdirectory>/<tag>": [[step, value], ...]}`` (numeric values;
    a tensor of more than 16 elements as the sum of its absolute values;
    text and images left out). Keyed by directory, not file name: the files'
    names carry a host, a process id and a time."""
    found = {}
    for directory, _, files in sorted(os.walk(logdir)):
        for name in sorted(f for f in files if "tfevents" in f):
            where = os.path.relpath(directory, logdir)
            for event in tf.compat.v1.train.summary_iterator(os.path.join(directory, name)):
                for value in event.summary.value:
                    number = _event_number(value)
                    if number is not None:
                        found.setdefault(f"{where}/{value.tag}", []).append([event.step, number])
    return {tag: sorted(points) for tag, points in sorted(found.items())}


def _event_number(value):
    if value.HasField("simple_value"):
        return float(value.simple_value)
    if not value.HasField("tensor"):
        return None
    array = tf.make_ndarray(value.tensor)
    if array.dtype.kind not in "biuf":
        return None
    if array.size > 16:
        return float(np.sum(np.abs(array.astype(np.float64))))
    return array.astype(np.float64).tolist()


def all_workers(value):
    """``value`` of every worker (every rank; this process alone under MirroredStrategy),
    for a report of what the tutorial's code sees only locally (per-replica results)."""
    return _COMM.allgather(value) if _COMM is not None else [value]


def report(numbers):
    """Prints ``numbers`` as one JSON object: the program's last line."""
    global LAST_REPORT
    LAST_REPORT = _plain(numbers)
    print(json.dumps(LAST_REPORT, sort_keys=True), flush=True)
