"""Every private TensorFlow symbol mpi_strategy uses, behind one version check.

TensorFlow's distribute internals move between releases. Keeping each private
import here means a new TF release breaks (at most) this file, loudly, at
import time, instead of somewhere deep inside a training step.
"""

import tensorflow as tf

from mpi_strategy.errors import MPIStrategyError
from mpi_strategy.logs import logger

SUPPORTED_TF = ((2, 16), (2, 21))  # inclusive range this file was checked against


def _tf_version():
    return tuple(int(p) for p in tf.__version__.split(".")[:2])


_version = _tf_version()
if _version < SUPPORTED_TF[0]:
    raise MPIStrategyError(
        f"mpi_strategy needs TensorFlow >= {'.'.join(map(str, SUPPORTED_TF[0]))}; "
        f"found {tf.__version__}. Upgrade with: pip install -U 'tensorflow>=2.16'"
    )
if _version > SUPPORTED_TF[1]:
    logger.warning(
        "mpi_strategy was tested with TensorFlow up to %s; found %s. "
        "If something fails in mpi_strategy/_tf_internal.py, TensorFlow's "
        "private distribute API changed.",
        ".".join(map(str, SUPPORTED_TF[1])), tf.__version__)

try:
    # pylint: disable=g-direct-tensorflow-import
    from tensorflow.python.distribute import cross_device_ops as _cross_device_ops
    from tensorflow.python.distribute import distribute_utils as _distribute_utils
    from tensorflow.python.distribute import input_util as _input_util
    from tensorflow.python.distribute import mirrored_strategy as _mirrored_strategy
    from tensorflow.python.framework import ops as _ops
    from tensorflow.python.ops import control_flow_util as _control_flow_util
except ImportError as exc:  # pragma: no cover - only on an untested TF
    raise MPIStrategyError(
        f"TensorFlow {tf.__version__} moved a private module mpi_strategy relies "
        f"on ({exc}). Install a TensorFlow between 2.16 and 2.21."
    ) from exc

# The single-process mirrored machinery MPIStrategy extends across ranks.
MirroredExtended = _mirrored_strategy.MirroredExtended
regroup = _distribute_utils.regroup
simple_broadcast = _cross_device_ops.simple_broadcast
get_distributed_dataset = _input_util.get_distributed_dataset
get_distributed_datasets_from_function = _input_util.get_distributed_datasets_from_function


def in_xla_context():
    """True when the op being built will be compiled by XLA (jit_compile=True)."""
    return _control_flow_util.GraphOrParentsInXlaContext(_ops.get_default_graph())


def is_mirrored(value):
    return _distribute_utils.is_mirrored(value)
