"""``horovod.tensorflow.util``: the helpers Horovod programs and tests import."""

import tensorflow as tf


def _executing_eagerly() -> bool:
    """Whether TensorFlow runs eagerly here (Horovod's name)."""
    return bool(tf.executing_eagerly())


__all__ = ["_executing_eagerly"]
