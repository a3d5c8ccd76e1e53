"""Horovod's API (a second public face) on the library's ordered MPI core."""
