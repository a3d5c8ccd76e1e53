"""features/saving/ and features/at_exit.py, in programs of their own: saving at the
end of a program, and killed mid-write.

Rank 0 saving alone while the other ranks end their program works, or (when
the save needs them) fails with the cause instead of hanging
(tests/programs/save_at_the_end_of_the_program.py). A process SIGKILLed in
the middle of a checkpoint write leaves the latest checkpoint usable
(tests/programs/keep_saving_checkpoints.py). The saves made by every rank of
a running job: tests/any_world_size/features/saving/test_saving.py.
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from mpi_testing import program
from testing.launch import python_argv, run_mpiexec


@pytest.mark.single_process
def test_rank0_saving_alone_at_the_end_of_the_program(tmp_path):
    script = program("save_at_the_end_of_the_program.py")
    code, out = run_mpiexec(2, python_argv(script, str(tmp_path), "weights"), silence=120)
    assert code == 0 and "SAVED" in out, out[-3000:]
    assert os.path.exists(tmp_path / "ckpt.index")
    # A save that needs the other ranks (a metric) while they have ended: an
    # error naming both sides, not a hang.
    code, out = run_mpiexec(2, python_argv(script, str(tmp_path), "metric"), silence=120)
    assert code != 0, out[-3000:]
    assert "the end of the program" in out and "saving alone" in out, out[-3000:]


@pytest.mark.single_process
def test_a_kill_during_checkpoint_writes_leaves_the_latest_checkpoint_usable(tmp_path):
    def writing(directory):  # a "<name>_temp" directory: a save in progress
        return any(name.endswith("_temp") for name in os.listdir(directory))

    killed_mid_write = 0
    for attempt in range(6):
        directory = str(tmp_path / f"ckpt{attempt}")
        child = subprocess.Popen(
            [sys.executable, program("keep_saving_checkpoints.py"), directory],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert child.stdout.readline().strip() == "1"
        # Kill as soon as a save is seen in progress (not after a fixed sleep,
        # which on a loaded machine too often lands between two saves).
        deadline = time.monotonic() + 20
        while not writing(directory) and time.monotonic() < deadline:
            time.sleep(0.0005)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        killed_mid_write += writing(directory)  # the kill interrupted that save

        latest = tf.train.latest_checkpoint(directory)
        number = int(latest.rsplit("-", 1)[1])
        restored = tf.Variable(np.zeros([4_000_000], np.float32))
        tf.train.Checkpoint(v=restored).restore(latest).assert_existing_objects_matched()
        np.testing.assert_array_equal(restored.numpy()[[0, -1]], [number, number])
        if killed_mid_write:
            break
    assert killed_mid_write, "no kill landed inside a checkpoint write in 6 attempts"
