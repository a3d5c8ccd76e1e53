"""Benchmarks for mpi_strategy: run ``python -m benchmarks`` (see docs/benchmarks.md)."""

import json


def json_objects(text):
    """Every JSON object in ``text``: mpiexec may put two ranks' lines on one line."""
    decoder, objects, pos = json.JSONDecoder(), [], 0
    while (start := text.find("{", pos)) >= 0:
        try:
            obj, pos = decoder.raw_decode(text, start)
            objects.append(obj)
        except json.JSONDecodeError:
            pos = start + 1
    return objects


def load_average():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])
