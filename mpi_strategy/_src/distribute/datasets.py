"""Each rank's input: TensorFlow's distributed datasets over this rank's devices,
whose iterators stop their prefetch thread before they are freed.

Every rank reads its own pipeline (sharded by rank through the input context,
``MPIExtended.input_context``) with the iterators MirroredStrategy uses, so each
rank sees the elements MirroredStrategy would give its replicas, in the same
order. One thing is added, invisible in the elements: when an iterator is
dropped in eager mode, its multi-device iterator first stops its prefetch thread.

Why: TensorFlow's multi-device iterator (MirroredStrategy's reader; seen on TF
2.21) prefetches on the host in a thread that runs with the context of the first
device-side read, which belongs to a per-device iterator. Dropping the Python
iterator frees the per-device iterators first; the thread, still reading a
pipeline that uses that context (a parallel map and an autotuned prefetch
without default optimizations: Keras's input from arrays), then runs into freed
memory: a segfault at random, more often on a loaded node, under
MirroredStrategy too, and Keras 3 drops an iterator at every epoch.
Re-initialising the multi-device iterator on an empty dataset while the
per-device iterators still exist resets it (the thread cancelled and joined);
``take(0)`` makes no iterator of its input, so the pipeline's random state is
untouched (tests: distribute/test_datasets.py, and
tests/launchers/distribute/test_dropped_iterators.py for the crash).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from mpi_strategy._src import _tf_internal
from mpi_strategy._src.core.logs import logger


def distribute_dataset(
    dataset: tf.data.Dataset,
    input_workers: Any,
    strategy: tf.distribute.Strategy,
    *,
    num_replicas_in_sync: int,
    input_context: tf.distribute.InputContext,
    options: tf.distribute.InputOptions | None,
) -> Any:
    """``strategy.experimental_distribute_dataset``: this rank's shard of
    ``dataset`` (per ``input_context``), batches split over its devices."""
    _reject_per_replica_mode(options)
    if not _tf_internal.tf2_enabled():  # TF1 graphs: no eager iterator is dropped
        return _tf_internal.get_distributed_dataset(
            dataset,
            input_workers,
            strategy,
            num_replicas_in_sync=num_replicas_in_sync,
            input_context=input_context,
            options=options,
        )
    return _DistributedDataset(
        input_workers,
        strategy,
        dataset,
        num_replicas_in_sync=num_replicas_in_sync,
        input_context=input_context,
        options=options,
    )


def distribute_datasets_from_function(
    dataset_fn: Callable[..., tf.data.Dataset],
    input_workers: Any,
    strategy: tf.distribute.Strategy,
    *,
    input_context: tf.distribute.InputContext,
    options: tf.distribute.InputOptions | None,
) -> Any:
    """``strategy.distribute_datasets_from_function``: ``dataset_fn`` called
    once on every rank with that rank's ``input_context``."""
    _reject_per_replica_mode(options)
    if not _tf_internal.tf2_enabled():
        return _tf_internal.get_distributed_datasets_from_function(
            dataset_fn, input_workers, [input_context], strategy, options=options
        )
    return _DistributedDatasetsFromFunction(
        input_workers,
        strategy,
        input_contexts=[input_context],
        dataset_fn=dataset_fn,
        options=options,
    )


def _reject_per_replica_mode(options: tf.distribute.InputOptions | None) -> None:
    if (
        options is not None
        and options.experimental_replication_mode == tf.distribute.InputReplicationMode.PER_REPLICA
    ):
        raise NotImplementedError(
            "mpi_strategy: InputReplicationMode.PER_REPLICA is not supported; "
            "use the default PER_WORKER mode (one input pipeline per rank)."
        )


def _stop_prefetch_when_dropped(iterator: Any) -> Any:
    """Arranges for each multi-device iterator of ``iterator`` (eager only) to
    stop its prefetch thread when dropped, before its per-device iterators are
    freed: a weakref callback runs before the dropped object's attributes are
    cleared. Returns ``iterator``."""
    if tf.executing_eagerly():
        for reader in _tf_internal.multi_device_readers(iterator):
            finalizer = weakref.finalize(
                reader.owner, _stop_prefetch, reader.resource, reader.dataset, reader.device
            )
            finalizer.atexit = False  # no TensorFlow op while the interpreter ends
    return iterator


def _stop_prefetch(resource: Any, dataset: tf.data.Dataset, device: str) -> None:
    # A weakref callback runs wherever the last reference went, possibly while
    # a tf.function is traced: init_scope makes these ops eager.
    try:
        with tf.init_scope(), tf.device(device):
            _tf_internal.reinitialize_multi_device_iterator(resource, dataset.take(0))
    except tf.errors.OpError as exc:  # (TensorFlow's own deletion follows, as without this)
        logger.warning("mpi_strategy: could not stop a dropped iterator's prefetch: %s", exc)


class _DistributedDataset(_tf_internal.DistributedDataset):
    def __iter__(self) -> Any:
        return _stop_prefetch_when_dropped(super().__iter__())


class _DistributedDatasetsFromFunction(_tf_internal.DistributedDatasetsFromFunction):
    def __iter__(self) -> Any:
        return _stop_prefetch_when_dropped(super().__iter__())
