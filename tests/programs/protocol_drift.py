"""The wire protocol's load-time check, against drift on either side. Prints
one line per case, ``<case>: accepted`` or ``<case>: refused: <reason>``.

``python protocol_drift.py cxx DIR``: builds the kernels into DIR from a
protocol header with one constant edited (the C++ side drifted), and checks it.

``python protocol_drift.py python``: checks the kernels as built (the cache),
then again after one constant of core/protocol.py changed (the Python side
drifted). One library per process: loading one registers its ops.
"""

import ctypes
import sys
from pathlib import Path

from mpi_strategy._src.core import protocol
from mpi_strategy._src.native import build, engine

DRIFTED_FROM, DRIFTED_TO = "kPieceAlign = 8", "kPieceAlign = 16"


def check(case: str, path: Path) -> None:
    try:
        engine.check_protocol(ctypes.CDLL(str(path)), path)
        print(f"{case}: accepted", flush=True)
    except engine.Unavailable as error:
        print(f"{case}: refused: {error}", flush=True)


def main() -> None:
    if sys.argv[1] == "cxx":
        header = protocol.header()
        assert DRIFTED_FROM in header, f"the header no longer holds {DRIFTED_FROM}"
        drifted = Path(sys.argv[2], "cxx_drifted.so")
        build.compile_into(drifted, header.replace(DRIFTED_FROM, DRIFTED_TO))
        check("C++ side changed", drifted)
    else:
        built = build.library()
        check("unchanged", built)
        protocol.PIECE_ALIGN = 16
        check("Python side changed", built)


if __name__ == "__main__":
    main()
