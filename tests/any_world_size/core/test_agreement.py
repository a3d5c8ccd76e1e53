"""The agreement (core/agreement.py, core/protocol.py) carries a rank's
preemption notice to every rank: all ranks learn it from the same collective,
on both engines and both ways of agreeing, without an MPI call of its own.

The agreement's other duty, that ranks calling different collectives (or
late past a timeout) all raise, is tested through OrderedComm in
distribute/test_ordered_comm.py; at 40 ranks (records that shrink):
tests/launchers/core/test_agreement_at_scale.py."""

import signal

import numpy as np
import pytest
import tensorflow as tf

from mpi_strategy._src.core import agreement as agreement_lib
from mpi_strategy._src.core.process import PROCESS
from mpi_strategy._src.core.protocol import State
from mpi_testing import RANK, SIZE, assert_same_on_all_ranks, on_python_engine, ordered_comm

pytestmark = pytest.mark.device_agnostic

ENGINES = [(engine, way) for engine in ("native", "python") for way in ("gathered", "hashed")]


@pytest.fixture(params=ENGINES, ids=["-".join(p) for p in ENGINES])
def ordered(request):
    """A new OrderedComm on one engine, agreeing one way; no notice posted
    on this rank before, none left in any communicator after."""
    engine, way = request.param
    posted = PROCESS.notice
    PROCESS.notice = 0
    ordered = ordered_comm(hashed=way == "hashed")
    if engine == "python":
        on_python_engine(ordered)
    elif "native" not in ordered.engines and SIZE > 1:
        pytest.skip("the native kernels are not in use (MPI_STRATEGY_KERNELS)")
    yield ordered
    PROCESS.notice = posted
    for live in PROCESS.agreements:  # (every rank alike: no notice left)
        live.state[[State.NOTICE, State.NOTICED, State.NOTICED_AT]] = 0


COLLECTIVES = {
    "small allreduce": lambda o: o.allreduce_sum(tf.constant([1.0, 2.0])),
    "large allreduce": lambda o: o.allreduce_sum(tf.ones([20000])),
    "broadcast": lambda o: o.broadcast(tf.constant([RANK, 7])),
    "allgather": lambda o: o.allgather(tf.ones([RANK + 1, 3])),
}


@pytest.mark.skipif(SIZE == 1, reason="a 1-rank world calls no collective")
@pytest.mark.parametrize("collective", list(COLLECTIVES))
@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "function"])
def test_a_notice_on_the_last_rank_reaches_every_rank_in_the_next_collective(
    ordered, collective, in_function
):
    run = COLLECTIVES[collective]
    call = (
        (lambda: run(ordered))
        if not in_function
        else tf.function(autograph=False)(lambda: run(ordered))
    )
    agreement = ordered.agreement
    call()
    assert agreement.noticed is None
    if RANK == SIZE - 1:
        agreement_lib.post_notice(signal.SIGTERM)
    assert agreement.noticed is None  # (learnt from a collective, not posted)
    call()
    assert agreement.noticed == (signal.SIGTERM, agreement.seq)
    assert_same_on_all_ranks(np.array(agreement.noticed), "the notice and its collective")
    learnt_at = agreement.seq
    if RANK == 0:  # a second notice, on another rank: the first one stays
        agreement_lib.post_notice(signal.SIGUSR1)
    call()
    assert agreement.noticed == (signal.SIGTERM, learnt_at)


def test_a_communicator_made_after_the_notice_carries_it(ordered):
    if RANK == SIZE - 1:
        agreement_lib.post_notice(signal.SIGUSR1)
    later = on_python_engine(ordered_comm())
    later.allreduce_sum(tf.constant(1.0))
    assert later.agreement.noticed == (signal.SIGUSR1, later.agreement.seq)
    assert_same_on_all_ranks(np.array(later.agreement.noticed), "the notice and its collective")


@pytest.mark.skipif(SIZE > 1, reason="alone, a rank learns its own notice at once")
def test_alone_a_rank_learns_its_own_notice_at_once(ordered):
    assert ordered.agreement.noticed is None
    agreement_lib.post_notice(signal.SIGTERM)
    assert ordered.agreement.noticed == (signal.SIGTERM, ordered.agreement.seq)
