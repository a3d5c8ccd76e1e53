"""mpi_strategy's implementation, in layers that import only downward.

Their order is written once, in the repository's ``.importlinter`` (checked
by ``tests/architecture``); docs/concepts.md ("Layers") says what each folder
holds. The public modules (``mpi_strategy``, ``.errors``, ``.compression``,
``.elastic``, ``.timeline``, ``.horovod``) sit on top.
"""
