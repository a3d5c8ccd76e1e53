"""distribute/datasets.py: every dropped iterator of both kinds of distributed
dataset stops its prefetch, and that leaves the elements read unchanged, at any
world size and local device count (that it prevents the crash:
tests/launchers/distribute/test_dropped_iterators.py); the input mode it does not
support is refused on every rank."""

import gc

import numpy as np
import pytest
import tensorflow as tf

from mpi_strategy._src import _tf_internal
from mpi_strategy._src.distribute import datasets
from mpi_testing import LOCAL_DEVICES, assert_same_on_all_ranks

ITERATORS = 4


def _reshuffled(batch):
    # The same seed each call: two such datasets shuffle alike, iteration by
    # iteration, as long as each makes the same iterators of its pipeline.
    return tf.data.Dataset.range(6 * batch).shuffle(6 * batch, seed=7).batch(batch)


def _from_dataset(strategy, tensorflows):
    batch = 2 * strategy.num_replicas_in_sync
    if not tensorflows:
        return strategy.experimental_distribute_dataset(_reshuffled(batch))
    extended = strategy.extended
    return _tf_internal.get_distributed_dataset(
        _reshuffled(batch),
        extended._input_workers_with_options(None),
        strategy,
        num_replicas_in_sync=strategy.num_replicas_in_sync,
        input_context=extended.input_context(),
    )


def _from_function(strategy, tensorflows):
    def dataset_fn(context):
        return _reshuffled(context.get_per_replica_batch_size(2 * strategy.num_replicas_in_sync))

    if not tensorflows:
        return strategy.distribute_datasets_from_function(dataset_fn)
    extended = strategy.extended
    return _tf_internal.get_distributed_datasets_from_function(
        dataset_fn,
        extended._input_workers_with_options(None),
        [extended.input_context()],
        strategy,
    )


def _first_batches(distributed, strategy):
    """The first two local batches of each of ITERATORS fresh iterators, each
    dropped (and collected) before the next is made."""
    seen = []
    for _ in range(ITERATORS):
        iterator = iter(distributed)
        for _ in range(2):
            local = strategy.experimental_local_results(next(iterator))
            seen.append(np.concatenate([t.numpy() for t in local]))
        del iterator
        gc.collect()
    return np.stack(seen)


@pytest.mark.parametrize("distribute", [_from_dataset, _from_function], ids=lambda f: f.__name__)
def test_dropped_iterators_stop_and_read_what_tensorflows_own_read(
    strategy, distribute, monkeypatch
):
    stopped = []
    stop = datasets._stop_prefetch
    monkeypatch.setattr(datasets, "_stop_prefetch", lambda *args: stopped.append(stop(*args)))
    expected = _first_batches(distribute(strategy, tensorflows=True), strategy)
    assert not stopped  # TensorFlow's own datasets: nothing added
    got = _first_batches(distribute(strategy, tensorflows=False), strategy)
    assert len(stopped) == ITERATORS  # one multi-device iterator per rank and iterator
    np.testing.assert_array_equal(got, expected)
    assert len({tuple(batch) for batch in got[::2]}) > 1  # it does reshuffle
    assert got.shape[1] == 2 * LOCAL_DEVICES
    assert_same_on_all_ranks(np.array(got.shape), "batches read")


def test_per_replica_input_mode_is_refused_on_every_rank(strategy):
    options = tf.distribute.InputOptions(
        experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA,
        experimental_fetch_to_device=False,
    )
    with pytest.raises(NotImplementedError, match="PER_REPLICA is not supported"):
        strategy.experimental_distribute_dataset(_reshuffled(2), options)
    with pytest.raises(NotImplementedError, match="PER_REPLICA is not supported"):
        strategy.distribute_datasets_from_function(lambda _: _reshuffled(2), options)
