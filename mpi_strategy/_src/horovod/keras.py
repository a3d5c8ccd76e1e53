"""Horovod's ``load_model``, the Keras faces of the collectives (Keras 3
and tf_keras), and which ``SyncBatchNormalization`` they export; the optimizer
is ``optimizer.py``'s, batch normalization ``sync_batch_norm.py``'s."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from mpi_strategy._src.horovod import api, functions, mpi_ops, sync_batch_norm
from mpi_strategy._src.horovod.compression import Compression, Compressor
from mpi_strategy._src.horovod.mpi_ops import Average
from mpi_strategy._src.horovod.optimizer import (
    DistributedOptimizer,
    _Keras3Methods,
    _TFKerasMethods,
    default_keras_package,
    keras_module,
    keras_package,
)

keras: Any = importlib.import_module("keras")


def sync_batch_normalization() -> type:
    """The ``SyncBatchNormalization`` of ``tf.keras``'s package, as Horovod's:
    tf_keras's under ``TF_USE_LEGACY_KERAS=1`` (imported only then), else Keras 3's."""
    if default_keras_package() == "tf_keras":
        from mpi_strategy._src.horovod import sync_batch_norm_tf_keras

        return sync_batch_norm_tf_keras.SyncBatchNormalization
    return sync_batch_norm.SyncBatchNormalization


# -- load_model and the Keras faces of the collectives ----------------------------------


def load_model(
    filepath: Any,
    custom_optimizers: Sequence[type] | None = None,
    custom_objects: dict[str, Any] | None = None,
    compression: type[Compressor] = Compression.none,
    legacy_opts: bool = False,
) -> Any:
    """The saved Keras model (loaded by ``tf.keras``'s package) with its
    optimizer wrapped in ``DistributedOptimizer``, the saved optimizer state
    kept. ``custom_optimizers``: optimizer classes the file may name.
    ``legacy_opts``: accepted (the saved class decides)."""
    objects: dict[str, Any] = {cls.__name__: cls for cls in custom_optimizers or []}
    objects.update(custom_objects or {})
    package = default_keras_package()
    model = keras_module(package, "models").load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and keras_package(optimizer) is not None:
        distributed: Any = DistributedOptimizer(optimizer, compression=compression)
        if isinstance(distributed, _Keras3Methods):
            with keras.name_scope(optimizer.name, caller=distributed):
                distributed.build(model.trainable_variables)
        elif isinstance(distributed, _TFKerasMethods) and model.trainable_variables:
            with tf.init_scope():
                distributed.build(model.trainable_variables)
        model.optimizer = distributed
    return model


def broadcast_global_variables(root_rank: int) -> None:
    """TensorFlow 1's global variables (Horovod raises in eager mode, as here):
    use ``BroadcastGlobalVariablesCallback`` or ``hvd.broadcast_variables``."""
    functions.broadcast_global_variables(root_rank)


def allreduce(
    value: Any,
    name: str | None = None,
    average: bool | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    op: int | None = None,
    compression: type[Compressor] = Compression.none,
) -> tf.Tensor:
    """``value`` (tensor-like, one shape on every rank) reduced over every
    rank (default: averaged); the same tensor on every rank."""
    return api.allreduce(
        tf.convert_to_tensor(value),
        average=average,
        compression=compression,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
    )


def allgather(value: Any, name: str | None = None) -> tf.Tensor:
    """Every rank's ``value`` concatenated along axis 0, in rank order, on every rank."""
    return mpi_ops.allgather(tf.convert_to_tensor(value))


def broadcast(value: Any, root_rank: int, name: str | None = None) -> tf.Tensor:
    """``value`` as it is on ``root_rank``, on every rank."""
    return mpi_ops.broadcast(tf.convert_to_tensor(value), root_rank)


def reducescatter(value: Any, name: str | None = None, op: int = Average) -> tf.Tensor:
    """``value`` (one shape on every rank) reduced over the ranks; this rank
    gets its rows (``len // size``, one more on the first ``len % size`` ranks)."""
    return api.reducescatter(tf.convert_to_tensor(value), op=op)
