"""The wire protocol's load-time check, against drift on either side.

``python protocol_drift.py build DIR``: builds the native kernels twice into
DIR, ``as_is.so`` as they are and ``cxx_drifted.so`` from a protocol header
with one constant edited (the C++ side drifted).

``python protocol_drift.py check LIBRARY [python-drift]``: asks the loader to
check LIBRARY against core/protocol.py, after changing one Python constant
with ``python-drift`` (the Python side drifted); prints ``accepted`` or
``refused: <reason>``. One library per process: loading one registers its ops.
"""

import ctypes
import sys
from pathlib import Path

from mpi_strategy._src.core import protocol
from mpi_strategy._src.native import build, engine

DRIFTED_FROM, DRIFTED_TO = "kPieceAlign = 8", "kPieceAlign = 16"


def main() -> None:
    if sys.argv[1] == "build":
        header = protocol.header()
        assert DRIFTED_FROM in header, f"the header no longer holds {DRIFTED_FROM}"
        build.compile_into(Path(sys.argv[2], "as_is.so"), header)
        build.compile_into(
            Path(sys.argv[2], "cxx_drifted.so"), header.replace(DRIFTED_FROM, DRIFTED_TO)
        )
        return
    path = Path(sys.argv[2])
    if sys.argv[3:] == ["python-drift"]:
        protocol.PIECE_ALIGN = 16
    try:
        engine.check_protocol(ctypes.CDLL(str(path)), path)
        print("accepted", flush=True)
    except engine.Unavailable as error:
        print(f"refused: {error}", flush=True)


if __name__ == "__main__":
    main()
