"""distribute/datasets.py: what stopping a dropped iterator's prefetch leaves
unchanged, at any world size and local device count (that it prevents the crash:
tests/launchers/distribute/test_dropped_iterators.py)."""

import gc

import numpy as np
import tensorflow as tf

from mpi_strategy._src import _tf_internal
from mpi_testing import assert_same_on_all_ranks


def _reshuffled(strategy):
    # The same seed each call: two such datasets shuffle alike, iteration by
    # iteration, as long as each makes the same iterators of its pipeline.
    batch = 2 * strategy.num_replicas_in_sync
    return tf.data.Dataset.range(6 * batch).shuffle(6 * batch, seed=7).batch(batch)


def _first_batches(distributed, strategy, iterations=4):
    """The first two local batches of each of ``iterations`` fresh iterators,
    each dropped (and collected) before the next is made."""
    seen = []
    for _ in range(iterations):
        iterator = iter(distributed)
        for _ in range(2):
            local = strategy.experimental_local_results(next(iterator))
            seen.append(np.concatenate([t.numpy() for t in local]))
        del iterator
        gc.collect()
    return np.stack(seen)


def test_dropped_iterators_leave_the_reshuffling_order_as_tensorflows_own(strategy):
    extended = strategy.extended
    tensorflows = _tf_internal.get_distributed_dataset(
        _reshuffled(strategy),
        extended._input_workers_with_options(None),
        strategy,
        num_replicas_in_sync=strategy.num_replicas_in_sync,
        input_context=extended.input_context(),
    )
    ours = strategy.experimental_distribute_dataset(_reshuffled(strategy))
    assert type(iter(tensorflows)) is type(iter(ours))  # the same iterators
    expected = _first_batches(tensorflows, strategy)
    got = _first_batches(ours, strategy)
    np.testing.assert_array_equal(got, expected)
    assert len({tuple(batch) for batch in got[::2]}) > 1  # it does reshuffle
    assert_same_on_all_ranks(np.array(got.shape), "batches read")
