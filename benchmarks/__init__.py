"""Benchmarks for mpi_strategy: run ``python -m benchmarks`` (see docs/benchmarks.md)."""
