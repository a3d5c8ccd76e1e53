"""The framework-free MPI core: numpy and mpi4py only (no TensorFlow)."""
