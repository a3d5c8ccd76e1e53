"""Horovod's ``SyncBatchNormalization``: batch statistics over the process set.

One layer per Keras, as Horovod's is ``tf.keras``'s: Keras 3's here, tf_keras's
in ``sync_batch_norm_tf_keras.py``; ``keras.sync_batch_normalization()`` is
the public name's.
"""

from __future__ import annotations

import importlib
from typing import Any

import tensorflow as tf

from mpi_strategy._src import _keras_internal
from mpi_strategy._src.horovod import basics, mpi_ops
from mpi_strategy._src.horovod.mpi_ops import Sum

keras: Any = importlib.import_module("keras")


def refuse_fused(fused: bool | None) -> None:
    """Horovod's check: the statistics of a fused batch norm are not synchronized."""
    if fused in (True, None):
        raise ValueError("SyncBatchNormalization does not support fused=True.")


def moments_over_ranks(
    x: tf.Tensor, axes: list[int], mask: Any, keepdims: bool = False
) -> tuple[tf.Tensor, tf.Tensor]:
    """The mean and variance of ``x`` over ``axes`` and over the batches of
    every rank of the global process set together (of any sizes; ``mask``: a
    weight per element of ``x`` but its last axis, or None). Every rank gets
    the same two tensors; the gradient flows to every rank's ``x``."""
    if mask is None:
        total = tf.reduce_sum(x, axes, keepdims=keepdims)
        squares = tf.reduce_sum(tf.square(x), axes, keepdims=keepdims)
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype)
        count = tf.fill(tf.shape(total), count)
    else:
        weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(x)), x.dtype)
        total = tf.reduce_sum(x * weights, axes, keepdims=keepdims)
        squares = tf.reduce_sum(tf.square(x) * weights, axes, keepdims=keepdims)
        count = tf.reduce_sum(weights, axes, keepdims=keepdims)
    total, squares, count = mpi_ops._grouped_allreduce([total, squares, count], op=Sum)
    mean = tf.math.divide_no_nan(total, count)
    variance = tf.maximum(tf.math.divide_no_nan(squares, count) - tf.square(mean), 0.0)
    return mean, variance


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Keras 3's ``BatchNormalization`` whose batch statistics, in training,
    are those of the batches of every rank of the global process set together
    (ranks may have batches of different sizes): every rank normalizes with
    the same mean and variance and keeps the same moving averages. Its
    gradient flows to every rank's inputs. Needs ``hvd.init()``.
    """

    def __init__(self, fused: bool | None = False, **kwargs: Any) -> None:
        refuse_fused(fused)
        _keras_internal.check_overridden(_keras_internal.BATCH_NORM_MOMENTS)
        super().__init__(**kwargs)

    def _moments(self, inputs: Any, mask: Any) -> tuple[tf.Tensor, tf.Tensor]:
        """The batch's mean and variance over every rank (listed in
        ``_keras_internal.BATCH_NORM_MOMENTS``)."""
        if basics.size() == 1:
            return super()._moments(inputs, mask)
        x = tf.convert_to_tensor(inputs)
        axis = self.axis % x.shape.rank
        return moments_over_ranks(x, [i for i in range(x.shape.rank) if i != axis], mask)
