"""distribute/cross_device_ops.py: what is reduced, and with how many MPI calls."""

import numpy as np
import pytest
import tensorflow as tf

from mpi_strategy import MPICrossDeviceOps
from mpi_testing import NUM_REPLICAS, RANK, SIZE, mpi_calls


def _mpi_op_counts(concrete_function):
    counts = {}
    for name, _ in mpi_calls(concrete_function.graph):
        counts[name] = counts.get(name, 0) + 1
    return counts


def test_batch_reduce_is_one_allreduce_per_dtype(strategy):
    if SIZE == 1:
        pytest.skip("a 1-rank world issues no MPI call")

    @tf.function
    def step():
        def fn():
            r = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
            grads = [
                tf.fill([3, 4], r),
                tf.fill([7], r),
                tf.fill([], r),
                tf.cast(tf.fill([2], r), tf.float64),
                tf.fill([5, 1], r),
            ]
            return tf.distribute.get_replica_context().all_reduce("SUM", grads)

        return strategy.experimental_local_results(strategy.run(fn))[0]

    concrete = step.get_concrete_function()
    counts = _mpi_op_counts(concrete)
    assert counts == {"MPIAllreduce": 2}, counts  # float32 and float64
    out = step()
    total = NUM_REPLICAS * (NUM_REPLICAS - 1) / 2
    for t in out:
        np.testing.assert_array_equal(t.numpy(), np.full(t.shape, total))


def test_sparse_gradients_of_many_tables_are_one_allgather(strategy):
    # Three embedding-like tables: each replica touches rows of each; the
    # sum stays IndexedSlices and all tables travel in one MPI call.
    if SIZE == 1:
        pytest.skip("a 1-rank world issues no MPI call")

    @tf.function
    def step():
        def fn():
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            grads = [
                tf.IndexedSlices(
                    tf.fill([k + 1, k + 2], tf.cast(r + 1, tf.float32)),
                    indices=tf.range(k + 1) + r,
                    dense_shape=tf.constant([20, k + 2]),
                )
                for k in range(3)
            ]
            dense = tf.fill([4], tf.cast(r, tf.float32))
            return tf.distribute.get_replica_context().all_reduce("SUM", [*grads, dense])

        return strategy.experimental_local_results(strategy.run(fn))[0]

    # The small dense value rides along in the same all_gather.
    assert _mpi_op_counts(step.get_concrete_function()) == {"MPIAllgather": 1}
    out = step()
    for k in range(3):
        assert isinstance(out[k], tf.IndexedSlices)
        dense = tf.convert_to_tensor(out[k]).numpy()
        expected = np.zeros([20, k + 2], np.float32)
        for r in range(NUM_REPLICAS):
            expected[r : r + k + 1] += r + 1
        np.testing.assert_array_equal(dense, expected)
    total = NUM_REPLICAS * (NUM_REPLICAS - 1) / 2
    np.testing.assert_array_equal(out[3].numpy(), np.full([4], total))


def test_communicator_and_worker_count():
    ops = MPICrossDeviceOps()
    assert ops.comm.Get_size() == SIZE
    assert ops._num_between_graph_workers == SIZE


def test_plain_tensor_counts_as_one_value_per_rank(strategy):
    # Outside strategy.run, a plain tensor is this rank's value.
    total = strategy.extended.reduce_to("SUM", tf.constant(float(RANK + 1)), "/device:CPU:0")
    mean = strategy.extended.reduce_to("MEAN", tf.constant(float(RANK + 1)), "/device:CPU:0")
    assert float(total) == SIZE * (SIZE + 1) / 2
    assert float(mean) == pytest.approx((SIZE + 1) / 2)


def test_mpi_ops_land_on_requested_destinations(strategy):
    per_replica = strategy.run(lambda: tf.constant(1.0))
    devices = strategy.extended.worker_devices
    mirrored = strategy.extended.reduce_to("SUM", per_replica, per_replica)
    locals_ = strategy.experimental_local_results(mirrored)
    assert len(locals_) == len(devices)
    for value, device in zip(locals_, devices):
        assert value.device == device
        assert float(value) == NUM_REPLICAS
