"""Shared infrastructure of tests and benchmarks (not part of the installed package).

``testing.launch`` runs programs under a real ``mpiexec`` (or Open MPI's
``mpirun``) and kills a launch that has printed nothing for too long;
``testing.netns_cluster`` builds "hosts" out of network namespaces. Both
``tests/`` and ``benchmarks/`` import them as ``testing.<module>``, from the
repository root: pytest puts the root on ``sys.path`` through the root
``conftest.py``, and ``python -m benchmarks`` runs from the root.
"""
