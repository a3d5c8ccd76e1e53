"""The tf.distribute binding: MPI collectives as ordered TF ops, MPICrossDeviceOps, MPIStrategy."""
