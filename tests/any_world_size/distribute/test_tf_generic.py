"""TensorFlow's own generic strategy tests (strategy_test_lib, shipped in the wheel)
against distribute/strategy.py.

They run against MPIStrategy on every rank of the launch. Left out:
``_test_minimize_loss_graph`` and ``_test_numpy_dataset`` (TF1 sessions; MPIStrategy
is TF2-only) and ``_test_replica_id`` (it assumes replica ids are local, which
no multi-worker strategy satisfies).
"""

import tensorflow as tf
from tensorflow.python.distribute import strategy_test_lib  # test-only private import

from mpi_testing import mpi_strategy_under_test

_STRATEGY = None


def _strategy():
    global _STRATEGY
    if _STRATEGY is None:
        _STRATEGY = mpi_strategy_under_test()
    return _STRATEGY


class MPIStrategyGenericTest(strategy_test_lib.DistributionTestBase):
    def test_minimize_loss_eager(self):
        self._test_minimize_loss_eager(_strategy())

    def test_call_and_merge_exceptions(self):
        self._test_call_and_merge_exceptions(_strategy())

    def test_global_step_update(self):
        self._test_global_step_update(_strategy())

    def test_trainable_variable(self):
        self._test_trainable_variable(_strategy())

    def test_input_fn_iterable(self):
        strategy = _strategy()
        resolver = strategy.cluster_resolver
        local = len(strategy.extended.worker_devices)
        elements = 2 * strategy.num_replicas_in_sync  # every rank reads them all
        expected = [[step * local + i for i in range(local)] for step in range(elements // local)]
        self._test_input_fn_iterable(
            strategy,
            self._input_fn_to_test_input_context(
                lambda: tf.data.Dataset.range(elements),
                expected_num_replicas_in_sync=strategy.num_replicas_in_sync,
                expected_num_input_pipelines=resolver.num_workers,
                expected_input_pipeline_id=resolver.task_id,
            ),
            expected_values=expected,
        )
