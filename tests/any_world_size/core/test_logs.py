"""core/logs.py: lines tagged with the rank; ranks other than 0 quiet."""

import io
import logging

import mpi_strategy
from mpi_strategy._src.core.logs import logger
from mpi_testing import RANK, SIZE, local_devices, mpi_strategy_under_test


def test_rank_0_logs_info_and_the_other_ranks_only_errors():
    assert logger.getEffectiveLevel() == (logging.INFO if RANK == 0 else logging.ERROR)


def test_options_the_strategy_ignores_are_named_once_on_rank_0():
    import tensorflow as tf

    (handler,) = [h for h in logger.handlers if type(h).__name__ == "_RankTaggedHandler"]
    stream = io.StringIO()
    previous = handler.setStream(stream)
    options = tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=1 << 20,
        implementation=tf.distribute.experimental.CommunicationImplementation.NCCL,
    )
    try:
        for _ in range(2):
            mpi_strategy.MPIStrategy(devices=local_devices(), communication_options=options)
    finally:
        handler.setStream(previous)
    warned = [line for line in stream.getvalue().splitlines() if "ignores" in line]
    assert len(warned) == (1 if RANK == 0 else 0), warned
    if RANK == 0:
        # bytes_per_pack is honoured (buckets), so not named.
        assert "implementation=NCCL" in warned[0] and "bytes_per_pack" not in warned[0]


def test_lines_carry_the_rank_and_strategy_creation_is_logged_on_rank_0():
    (handler,) = [h for h in logger.handlers if type(h).__name__ == "_RankTaggedHandler"]
    stream = io.StringIO()
    previous = handler.setStream(stream)
    try:
        mpi_strategy_under_test()
        logger.error("something to see on every rank")
    finally:
        handler.setStream(previous)
    lines = stream.getvalue().splitlines()
    assert f"[mpi_strategy rank {RANK}/{SIZE}] ERROR: something to see on every rank" in lines
    created = [line for line in lines if "INFO: MPIStrategy:" in line]
    assert len(created) == (1 if RANK == 0 else 0), lines
    if RANK == 0:
        assert f"{SIZE} rank(s) x" in created[0] and "collective timeout: none" in created[0]
