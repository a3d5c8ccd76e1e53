"""mpi_strategy's implementation, in layers that import only downward.

    core/        framework-free MPI: ordered calls' agreement, buffers, wire
                 formats, ULFM, timeline, logs, launching (numpy + mpi4py only)
    _tf_internal, _keras_internal
                 the compat boundary: every private TensorFlow / Keras symbol
    distribute/  the tf.distribute binding: MPI ops as TF ops, fusion,
                 compression, MPICrossDeviceOps, MPIStrategy
    features/    what makes a one-process program work unchanged: saving
                 (write points), Keras, elastic training
    effects.py   the one installer of process-wide effects

The public modules (``mpi_strategy``, ``.errors``, ``.compression``,
``.elastic``, ``.timeline``) sit on top. ``tests/architecture`` checks the
order.
"""
