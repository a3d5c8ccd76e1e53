"""Horovod's ``SyncBatchNormalization`` for tf_keras models (``tf.keras``
under ``TF_USE_LEGACY_KERAS=1``); Keras 3's is ``sync_batch_norm.py``'s."""

from __future__ import annotations

import importlib
from typing import Any

import tensorflow as tf

from mpi_strategy._src import _keras_internal
from mpi_strategy._src.horovod import basics
from mpi_strategy._src.horovod.sync_batch_norm import moments_over_ranks, refuse_fused

tf_keras: Any = importlib.import_module("tf_keras")


class SyncBatchNormalization(tf_keras.layers.BatchNormalization):
    """tf_keras's ``BatchNormalization`` with the batch statistics of every
    rank together, as ``sync_batch_norm.SyncBatchNormalization`` (which see)."""

    def __init__(self, fused: bool | None = False, **kwargs: Any) -> None:
        refuse_fused(fused)
        _keras_internal.check_overridden(_keras_internal.TF_KERAS_BATCH_NORM_MOMENTS)
        super().__init__(fused=False, **kwargs)

    def _calculate_mean_and_var(
        self, inputs: Any, reduction_axes: Any, keep_dims: bool, mask: Any = None
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """The batch's mean and variance over every rank (listed in
        ``_keras_internal.TF_KERAS_BATCH_NORM_MOMENTS``)."""
        if basics.size() == 1:
            return super()._calculate_mean_and_var(inputs, reduction_axes, keep_dims, mask)
        x = tf.convert_to_tensor(inputs)
        return moments_over_ranks(x, list(reduction_axes), mask, keepdims=keep_dims)
