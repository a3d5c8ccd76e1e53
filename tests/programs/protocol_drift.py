"""The wire protocol's load-time check, against drift on either side. Prints
one line per case, ``<case>: accepted`` or ``<case>: refused: <reason>``.

``python protocol_drift.py cxx DIR``: builds the kernels into DIR from a
protocol header with every item of CXX_DRIFTS edited that still compiles (the
C++ side drifted: the refusal names each), and once more with the library's
functions' signatures edited (which must not compile), and checks each
library (``check CASE PATH``, in a process of its own), or says ``not built:
<the compiler's error>``. (Two builds, not one per item: a build takes a core
for 10 s or more.)

``python protocol_drift.py python``: checks the kernels as built (the cache),
then again after one item of core/protocol.py changed, for each check (the
Python side drifted). One library per process: loading one registers its ops.
"""

import ctypes
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mpi_strategy._src.core import protocol
from mpi_strategy._src.native import build, engine

# Each check: (its name, the header's text, the same text drifted).
CXX_DRIFTS = {
    "align": ("kPieceAlign = 8", "kPieceAlign = 16"),
    "attribute default": ('{"root: int = 0", &Attrs::root}', '{"root: int = 1", &Attrs::root}'),
    "attribute list": ('    {"mpi_op: int = 0", &Attrs::mpi_op},\n', ""),
    "trace layout": (
        "  int64_t bytes;\n  int64_t tensors;",
        "  int64_t tensors;\n  int64_t bytes;",
    ),
    "bad-splits layout": ("  int64_t rows;\n  int64_t k;", "  int64_t k;\n  int64_t rows;"),
    "callback": ("char* message, int64_t capacity)", "char* message, int capacity)"),
    "announcements": ("1 * size + 1, 2 * size + 1", "1 * size + 0, 2 * size + 1"),
    "exports": (
        "mpi_strategy_state_open(int64_t engine, int64_t words)",
        "mpi_strategy_state_open(int64_t engine, int words)",
    ),
}


def _swap(fields, a, b):
    order = [dict(fields)[name] for name in (a, b)]
    swapped = {a: (b, order[1]), b: (a, order[0])}
    return tuple(swapped.get(name, (name, kind)) for name, kind in fields)


# Each check: (its name, protocol's attribute, its drifted value).
PYTHON_DRIFTS = {
    "align": ("PIECE_ALIGN", 16),
    "attribute default": (
        "ATTRS",
        tuple(a._replace(default=1) if a.name == "root" else a for a in protocol.ATTRS),
    ),
    "attribute list": ("ATTRS", (*protocol.ATTRS, protocol.Attr("extra", 0))),
    "trace layout": (
        "TRACE",
        protocol.TRACE._replace(fields=_swap(protocol.TRACE.fields, "bytes", "tensors")),
    ),
    "bad-splits layout": (
        "BAD_SPLITS",
        protocol.BAD_SPLITS._replace(fields=_swap(protocol.BAD_SPLITS.fields, "rows", "k")),
    ),
    "callback": ("CALLBACK", (*protocol.CALLBACK, ("extra", "int64"))),
    "exports": (
        "EXPORTS",
        {
            **protocol.EXPORTS,
            "mpi_strategy_state_close": protocol.Function("int64", (("engine", "int64"),)),
        },
    ),
    "announcements": ("ANNOUNCED", {**protocol.ANNOUNCED, "requests": (1, 2)}),
}


def check(case: str, path: Path) -> None:
    try:
        engine.check_protocol(ctypes.CDLL(str(path)), path)
        print(f"{case}: accepted", flush=True)
    except engine.Unavailable as error:
        print(f"{case}: refused: {error}", flush=True)


# The drifts built together, and the one built alone (it must not compile).
CXX_BUILDS = {
    "compiled": tuple(name for name in CXX_DRIFTS if name != "exports"),
    "exports": ("exports",),
}


def _drifted_library(directory: str, case: str) -> Path:
    header = protocol.header()
    for name in CXX_BUILDS[case]:
        was, drifted = CXX_DRIFTS[name]
        assert header.count(was) == 1, f"the header no longer holds {was!r} once"
        header = header.replace(was, drifted)
    path = Path(directory, f"{case}.so")
    build.compile_into(path, header)
    return path


def _build_and_check(directory: str, case: str) -> str:
    """A drifted library's check, in a process of its own (each loads one)."""
    try:
        path = _drifted_library(directory, case)
    except build.BuildError as error:  # (the library's functions: as declared, or no build)
        return f"C++ side changed ({case}): not built: {' '.join(str(error).split())}\n"
    argv = [sys.executable, __file__, "check", f"C++ side changed ({case})", str(path)]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    return (
        result.stdout
        if result.returncode == 0
        else f"C++ side changed ({case}): failed: {result.stderr[-500:]!r}\n"
    )


def main() -> None:
    if sys.argv[1] == "cxx":
        with ThreadPoolExecutor(2) as pool:  # (each is a whole build)
            for said in pool.map(lambda case: _build_and_check(sys.argv[2], case), CXX_BUILDS):
                print(said, end="", flush=True)
    elif sys.argv[1] == "check":
        check(sys.argv[2], Path(sys.argv[3]))
    else:
        built = build.library()
        check("unchanged", built)
        for name, (attribute, value) in PYTHON_DRIFTS.items():
            was = getattr(protocol, attribute)
            setattr(protocol, attribute, value)
            check(f"Python side changed ({name})", built)
            setattr(protocol, attribute, was)
        check("unchanged again", built)


if __name__ == "__main__":
    main()
