"""Horovod's TensorFlow API on mpi_strategy's ordered MPI collectives.

    import mpi_strategy.horovod.tensorflow as hvd         # was: import horovod.tensorflow as hvd
    import mpi_strategy.horovod.tensorflow.keras as hvd   # was: ...horovod.tensorflow.keras...

or run a Horovod program unchanged, with ``horovod`` resolved to this package:

    mpiexec -n 4 python -m mpi_strategy.horovod train.py [args]

See docs/migrating-from-horovod.md for every Horovod symbol: supported,
different (how), or not supported (why).
"""
