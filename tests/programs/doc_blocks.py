"""Run by tests/docs/test_docs.py: the runner of the docs' Python blocks.

``python doc_blocks.py PAYLOAD`` (in one process, or on 2 ranks under
mpiexec) runs the blocks that PAYLOAD (JSON, written by the test) lists: the
blocks of each page in one namespace, in page order, in the page's scratch
directory, each after its ``setup:`` code. Tracebacks point into the .md
file. Every rank stops at the first block that failed on any rank, printing
``DOCBLOCK FAILED page:line``; the exit status is 1 then. Shows that every
runnable Python block of README.md and docs/*.md runs as written.
"""

import json
import os
import sys

FAILED = "DOCBLOCK FAILED"  # tests/docs/test_docs.py looks for it


def _run_payload(payload_path):
    """Runs the blocks of each page in one namespace; every rank stops at the first failure."""
    import traceback

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    with open(payload_path) as f:
        payload = json.load(f)
    for page in payload["pages"]:
        os.makedirs(page["cwd"], exist_ok=True)
        os.chdir(page["cwd"])
        namespace = {"__name__": "__main__"}
        _register_source(page)
        for block in page["blocks"]:
            chunks = [
                *((code, line) for code, line in block["setups"]),
                (block["code"], block["line"]),
            ]
            error = None
            print(f"DOCBLOCK START {page['page']}:{block['line']}", flush=True)
            try:
                for code, line in chunks:
                    exec(compile("\n" * (line - 1) + code, page["page"], "exec"), namespace)
            except SystemExit as exc:
                if exc.code not in (None, 0):
                    error = f"SystemExit({exc.code!r})"
            except BaseException:  # noqa: BLE001 - report anything, on every rank, then stop together
                error = traceback.format_exc()
            if error is not None:
                print(
                    f"{FAILED} {page['page']}:{block['line']} on rank {comm.Get_rank()}:\n{error}",
                    flush=True,
                )
            if comm.allreduce(error is not None, op=MPI.LOR):
                return 1
    return 0


def _register_source(page):
    """Lets inspect / linecache find the blocks' code under the page's name.

    AutoGraph reads a function's source to convert it, and tracebacks quote
    it; both look the file name up in linecache. The page's code chunks are
    laid out at their own line numbers (everything else blank).
    """
    import linecache

    lines = []
    for block in page["blocks"]:
        for code, line in [*block["setups"], (block["code"], block["line"])]:
            chunk = code.splitlines(keepends=True)
            lines.extend(["\n"] * (line - 1 + len(chunk) - len(lines)))
            lines[line - 1 : line - 1 + len(chunk)] = chunk
    linecache.cache[page["page"]] = (sum(map(len, lines)), None, lines, page["page"])


if __name__ == "__main__":
    sys.exit(_run_payload(sys.argv[1]))
