"""``horovod.tensorflow.elastic`` on mpi_strategy: ``hvd.elastic.run``, the states.

    @hvd.elastic.run
    def train(state):
        step = tf.function(...)   # built here: traced again after a reset
        while state.batch < BATCHES:
            step(...)
            state.batch += 1
            state.commit()

    state = hvd.elastic.TensorFlowKerasState(model, optimizer, batch=0)
    state.register_reset_callbacks([lambda: optimizer.learning_rate.assign(LR * hvd.size())])
    train(state)

Launched with Open MPI 5's ``mpirun --with-ft ulfm``, a lost rank does not end
the job: the survivors restore the last commit, continue on fewer ranks
(``hvd.rank()`` and ``hvd.size()`` change), run the reset callbacks, take rank
0's state and call the function again. Without ULFM a lost rank ends the job.
Horovod's elastic driver (hosts added or removed by a discovery script) does not
exist here: workers are never added. See ``mpi_strategy._src.horovod.elastic``.
"""

from mpi_strategy._src.horovod.elastic import (
    ObjectState,
    StaleCollectiveError,
    State,
    TensorFlowKerasState,
    TensorFlowState,
    run,
)
from mpi_strategy._src.horovod.exceptions import HorovodInternalError, HostsUpdatedInterrupt

__all__ = [
    "TensorFlowKerasState",
    "TensorFlowState",
    "run",
    "State",
    "ObjectState",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "StaleCollectiveError",
]
