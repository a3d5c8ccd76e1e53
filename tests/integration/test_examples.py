"""The examples: each runs under mpiexec -n 2 and prints its result from rank 0;
the seed paper's workloads read their real file formats exactly."""

import gzip
import os
import re
import struct
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from mpi_testing import NUM_REPLICAS, REPO
from testing.launch import run_mpiexec

EXAMPLES = os.path.join(REPO, "examples")
# The examples import mpi_strategy from this checkout, wherever it is installed.
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}

sys.path.insert(0, EXAMPLES)
import adult_wide_deep  # noqa: E402
import cifar10_cnn  # noqa: E402
import higgs_dnn  # noqa: E402
import mnist_lenet  # noqa: E402


def run_example(script, args):
    code, out = run_mpiexec(
        2, [sys.executable, os.path.join(EXAMPLES, script), *args], silence=240, env=ENV
    )
    assert code == 0, out[-5000:]
    return re.sub(r"\[\d+\] ?", "", out)


@pytest.mark.single_process
@pytest.mark.parametrize(
    "script,args,expected",
    [
        ("keras_fit.py", ["--epochs", "1"], "test loss"),
        # Without ULFM or a failure it is a plain run (the kills:
        # tests/launchers/features/elastic/test_elastic.py).
        ("elastic_custom_loop.py", ["--steps", "20"], '"ranks_at_start": 2, "ranks_at_end": 2'),
        ("elastic_keras_fit.py", ["--epochs", "2"], '"ranks_at_start": 2, "ranks_at_end": 2'),
    ],
)
def test_example_runs_on_two_ranks(script, args, expected, tmp_path):
    if script == "keras_fit.py":
        args = [*args, "--output", str(tmp_path)]
    out = run_example(script, args)
    results = [line for line in out.splitlines() if expected in line]
    assert len(results) == 1, out[-5000:]  # printed by rank 0 only
    if script.startswith("elastic_"):  # no ULFM here: the log says how to get it
        assert (
            out.count("For elastic training, launch with Open MPI 5's `mpirun --with-ft ulfm`") == 1
        ), out[-5000:]


# custom_loop.py, the README's main example: rank 0's line after each epoch.
DIGITS_LINE = re.compile(
    r"^epoch (\d+)/10: loss (\d+\.\d{4})  accuracy [01]\.\d{4}  "
    r"test accuracy ([01]\.\d{4})  [\d,]+ examples/s$",
    re.M,
)


@pytest.mark.single_process
def test_custom_loop_learns_the_shipped_digits_on_two_ranks():
    # Its default run; CI runs its first epoch alone (README command 1 + --epochs 1).
    out = run_example("custom_loop.py", [])
    epochs = [(int(e), float(loss), float(acc)) for e, loss, acc in DIGITS_LINE.findall(out)]
    assert [e for e, _, _ in epochs] == list(range(1, 11)), out[-5000:]  # rank 0 only
    (_, first_loss, first_accuracy), (_, last_loss, last_accuracy) = epochs[0], epochs[-1]
    assert first_accuracy > 0.7, out[-5000:]  # measured 0.87 (chance: 0.1)
    assert last_loss < first_loss / 5, out[-5000:]  # measured 1.71 -> 0.10
    assert last_accuracy >= 0.95, out[-5000:]  # measured 0.98 on 360 held-out images


EPOCH_LINE = re.compile(
    r"^epoch 1/1: loss \d+\.\d{4}  accuracy [01]\.\d{4}  "
    r"throughput [\d,]+ samples/s \([\d,]+ per rank, 2 ranks\)$",
    re.M,
)


@pytest.mark.single_process
@pytest.mark.parametrize(
    "script", ["mnist_lenet.py", "cifar10_cnn.py", "higgs_dnn.py", "adult_wide_deep.py"]
)
def test_paper_workload_trains_on_two_ranks(script):
    out = run_example(script, ["--epochs", "1", "--steps-per-epoch", "3", "--examples", "1024"])
    # One epoch line with throughput, from rank 0 only; Keras' progress bar too.
    assert len(EPOCH_LINE.findall(out)) == 1, out[-5000:]
    assert "3/3" in out, out[-5000:]


# -- the --data readers, on tiny files in the real formats -----------------------
# They run once, outside mpiexec: the readers involve no MPI, and the last test
# checks what Keras hands to the strategy (tests/any_world_size/distribute/test_strategy.py
# checks the all-gather of IndexedSlices at every world size).


def _batches(dataset, parse, size=100):
    return [tf.nest.map_structure(np.asarray, b) for b in dataset.batch(size).map(parse)]


@pytest.mark.single_process
def test_mnist_reads_idx_files(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (5, 28, 28), dtype=np.uint8)
    labels = np.array([3, 0, 9, 1, 7], np.uint8)
    with gzip.open(tmp_path / "train-images-idx3-ubyte.gz", "wb") as f:  # as downloaded
        f.write(struct.pack(">IIII", 0x803, 5, 28, 28) + images.tobytes())
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(
        struct.pack(">II", 0x801, 5) + labels.tobytes()
    )
    records, n = mnist_lenet.read_idx(str(tmp_path))
    [(x, y)] = _batches(records, mnist_lenet.to_model_input)
    assert n == 5
    np.testing.assert_array_equal(x[..., 0], images / np.float32(255))
    np.testing.assert_array_equal(y, labels)

    (tmp_path / "train-labels-idx1-ubyte").write_bytes(struct.pack(">II", 0x803, 5))
    with pytest.raises(ValueError, match="not an IDX file"):
        mnist_lenet.read_idx(str(tmp_path))


@pytest.mark.single_process
def test_cifar10_reads_binary_batches(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (4, 3, 32, 32), dtype=np.uint8)  # R, G, B planes
    labels = np.array([6, 9, 0, 2], np.uint8)
    (tmp_path / "cifar-10-batches-bin").mkdir()
    records = np.concatenate([labels[:, None], images.reshape(4, -1)], axis=1)
    (tmp_path / "cifar-10-batches-bin" / "data_batch_1.bin").write_bytes(records.tobytes())
    dataset, n = cifar10_cnn.read_cifar10(str(tmp_path), ["data_batch_1.bin"])
    [(x, y)] = _batches(dataset, cifar10_cnn.to_model_input)
    assert n == 4
    np.testing.assert_array_equal(x, images.transpose(0, 2, 3, 1) / np.float32(255))
    np.testing.assert_array_equal(y, labels)

    (tmp_path / "data_batch_1.bin").write_bytes(records.tobytes()[:-1])
    with pytest.raises(ValueError, match="not a whole number"):
        cifar10_cnn.read_cifar10(str(tmp_path), ["data_batch_1.bin"])


@pytest.mark.single_process
def test_higgs_reads_csv(tmp_path):
    table = np.random.default_rng(0).normal(size=(3, 29))
    table[:, 0] = [1, 0, 1]
    text = "".join(",".join(f"{v:.18e}" for v in row) + "\n" for row in table)
    with gzip.open(tmp_path / "HIGGS.csv.gz", "wt") as f:  # as downloaded
        f.write(text)
    [(x, y)] = _batches(
        higgs_dnn.higgs_lines(str(tmp_path / "HIGGS.csv.gz")), higgs_dnn.parse_higgs
    )
    np.testing.assert_allclose(x, table[:, 1:], rtol=1e-6)
    np.testing.assert_array_equal(y, table[:, 0])

    # The synthetic lines are in the same format, with both classes.
    lines = higgs_dnn.synthetic_higgs_lines(256)
    assert lines == higgs_dnn.synthetic_higgs_lines(256)  # the same on every rank
    [(x, y)] = _batches(tf.data.Dataset.from_tensor_slices(lines), higgs_dnn.parse_higgs, 256)
    assert x.shape == (256, 28) and set(y) == {0.0, 1.0}


# Four records of adult.data, each on two lines here; the file ends with an empty line.
ADULT = (
    "39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, "
    "Male, 2174, 0, 40, United-States, <=50K\n"
    "52, Self-emp-inc, 287927, HS-grad, 9, Married-civ-spouse, Exec-managerial, Wife, White, "
    "Female, 15024, 0, 40, United-States, >50K\n"
    "54, ?, 180211, Some-college, 10, Married-civ-spouse, ?, Husband, Asian-Pac-Islander, "
    "Male, 0, 0, 60, South, >50K\n"
    "38, Private, 215646, HS-grad, 9, Divorced, Handlers-cleaners, Not-in-family, White, "
    "Male, 0, 0, 40, ?, <=50K\n"
    "\n"
)


@pytest.mark.single_process
def test_adult_reads_csv_with_missing_values(tmp_path):
    (tmp_path / "adult.data").write_text(ADULT)
    # adult.test's format: a header line, labels with a trailing dot.
    (tmp_path / "adult.test").write_text(
        "|1x3 Cross validator\n" + ADULT.replace("50K\n", "50K.\n")
    )
    for name in ("adult.data", "adult.test"):
        lines = adult_wide_deep.adult_lines(str(tmp_path / name))
        [(x, y)] = _batches(lines, adult_wide_deep.parse_adult)
        np.testing.assert_array_equal(y, [0, 1, 1, 0])
        np.testing.assert_allclose(
            x["numeric"][0], np.log1p([39, 77516, 13, 2174, 0, 40]), rtol=1e-6
        )
        assert x["workclass"][2] == 0 and x["occupation"][2] == 0  # "?": missing
        assert x["native_country"][3] == 0 and x["native_country"][2] != 0
        assert x["workclass"][0] != 0 and x["education"][1] == x["education"][3]
        assert x["education_x_occupation"][1] != x["education_x_occupation"][3]

    (tmp_path / "bad.data").write_text(ADULT.replace("<=50K", "<50K", 1))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"must be >50K or <=50K"):
        _batches(
            adult_wide_deep.adult_lines(str(tmp_path / "bad.data")), adult_wide_deep.parse_adult
        )


@pytest.mark.single_process
def test_adult_embedding_gradients_reach_the_strategy_sparse(strategy, tmp_path, monkeypatch):
    """Keras fit hands the embedding gradients to the strategy as IndexedSlices
    (which MPICrossDeviceOps all-gathers), not as dense tensors."""
    cross_device_ops = strategy.extended._cross_device_ops
    seen = []

    def first(value):  # a value of one replica
        return value.values[0] if isinstance(value, tf.distribute.DistributedValues) else value

    def recording_batch_reduce(reduce_op, value_destination_pairs, options=None):
        results = original(reduce_op, value_destination_pairs, options=options)
        for (value, _), result in zip(value_destination_pairs, results):
            seen.append(
                (
                    type(first(value)).__name__,
                    type(first(result)).__name__,
                    tuple(first(value).shape),
                )
            )
        return results

    original = cross_device_ops.batch_reduce
    monkeypatch.setattr(cross_device_ops, "batch_reduce", recording_batch_reduce)

    (tmp_path / "adult.data").write_text(ADULT)
    dataset = adult_wide_deep.distributed_dataset(
        strategy,
        adult_wide_deep.adult_lines(str(tmp_path / "adult.data")),
        global_batch=2 * NUM_REPLICAS,
        repeat=True,
    )
    with strategy.scope():
        model = adult_wide_deep.wide_and_deep()
        model.compile(optimizer="adam", loss="binary_crossentropy")
    model.fit(dataset, epochs=1, steps_per_epoch=1, verbose=0)

    tables = [
        layer.embeddings for layer in model.layers if isinstance(layer, keras.layers.Embedding)
    ]
    sparse = [s for s in seen if s[0] == "IndexedSlices"]
    assert len(tables) == 2 * len(adult_wide_deep.CATEGORICAL) + 1
    assert sorted(s[2] for s in sparse) == sorted(tuple(t.shape) for t in tables), seen
    assert all(s[1] == "IndexedSlices" for s in sparse), seen  # reduced, still sparse
