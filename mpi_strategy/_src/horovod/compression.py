"""Horovod's gradient compression: cast before the reduction, back after."""

from __future__ import annotations

from typing import Any

import tensorflow as tf


class Compressor:
    """Casts a tensor before a collective (``compress``) and back after (``decompress``)."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        """Returns the tensor to send and what ``decompress`` needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        """The received tensor, back in its own dtype."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        return tensor


class _CastCompressor(Compressor):
    wire: tf.DType = tf.float16

    @classmethod
    def compress(cls, tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        dtype = tensor.dtype
        if dtype.is_floating:
            return tf.cast(tensor, cls.wire), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        return tf.cast(tensor, ctx) if ctx is not None and ctx.is_floating else tensor


class FP16Compressor(_CastCompressor):
    """Floating-point tensors travel as float16: half the bytes of float32
    (summed in float32 and rounded once, ``horovod/mpi_ops.py``)."""

    wire = tf.float16


class BF16Compressor(_CastCompressor):
    """Floating-point tensors travel as bfloat16 (the library's extra; as fp16)."""

    wire = tf.bfloat16


class Compression:
    """``Compression.none``, ``Compression.fp16`` and (an extra) ``Compression.bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
