"""Run by tests/launchers/features/saving/test_saving_launched.py in one process:
``python keep_saving_checkpoints.py DIR``.

Writes 16 MB checkpoints to DIR with a CheckpointManager, one after another,
printing each number, until it is killed. The test SIGKILLs it in the middle
of a write and shows that the latest checkpoint left behind still restores.
"""

import sys

import numpy as np
import tensorflow as tf

variable = tf.Variable(np.zeros([4_000_000], np.float32))  # 16 MB per checkpoint
manager = tf.train.CheckpointManager(tf.train.Checkpoint(v=variable), sys.argv[1], max_to_keep=2)
step = 0
while True:
    step += 1
    variable.assign(tf.fill([4_000_000], float(step)))
    manager.save(checkpoint_number=step)
    print(step, flush=True)
