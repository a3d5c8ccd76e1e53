"""``horovod.tensorflow.keras.elastic`` on mpi_strategy: Keras' elastic state and callbacks.

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [
        hvd.elastic.CommitStateCallback(state),
        hvd.elastic.UpdateBatchStateCallback(state),
        hvd.elastic.UpdateEpochStateCallback(state),
    ]

    @hvd.elastic.run
    def train(state):
        model.fit(dataset, steps_per_epoch=..., epochs=EPOCHS - state.epoch, callbacks=callbacks)

    train(state)

After ranks are lost (Open MPI 5's ``mpirun --with-ft ulfm``), ``fit`` is called
again from the last commit, on the survivors; its train function is traced
again. See ``mpi_strategy.horovod.tensorflow.elastic`` for ``run`` and the states.
"""

from mpi_strategy._src.horovod.elastic import (
    CommitStateCallback,
    KerasState,
    TensorFlowKerasState,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
    run,
)

__all__ = [
    "KerasState",
    "CommitStateCallback",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
    "TensorFlowKerasState",
]
