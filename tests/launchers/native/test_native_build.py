"""native/build.py and native/engine.py: the native kernels are built at first use
into a cache, and chosen by ``MPI_STRATEGY_KERNELS``: without a compiler the
Python engine runs, with one line on rank 0 saying why; asked for explicitly,
their absence fails every rank."""

import os
import subprocess
import sys

import pytest

from mpi_testing import PROGRAMS
from testing.launch import run_mpiexec

FALLBACK = "mpi_strategy: using the Python collectives"


def _diagnose(ranks, tmp_path, **env):
    code, out = run_mpiexec(
        ranks,
        [sys.executable, "-m", "mpi_strategy"],
        silence=300,  # (a first use compiles the kernels)
        env={"MPI_STRATEGY_CACHE_DIR": str(tmp_path / "cache"), **env},
    )
    return code, out


def _engines(out, ranks):
    lines = [next(s for s in out.splitlines() if f"rank={r} " in s) for r in range(ranks)]
    return [line.split("kernels=")[1].split()[0] for line in lines]


@pytest.mark.single_process
def test_built_once_into_the_cache_then_used_without_a_compiler(tmp_path):
    code, out = _diagnose(2, tmp_path, MPI_STRATEGY_KERNELS="native")
    assert code == 0 and _engines(out, 2) == ["native", "native"], out[-3000:]
    built = list((tmp_path / "cache").glob("kernels-*.so"))
    assert len(built) == 1, built  # the ranks of a node build once (a file lock)
    stamp = built[0].stat().st_mtime_ns
    code, out = _diagnose(2, tmp_path, CXX="/nonexistent/c++")
    assert code == 0 and _engines(out, 2) == ["native", "native"], out[-3000:]
    assert built[0].stat().st_mtime_ns == stamp and FALLBACK not in out


@pytest.mark.single_process
def test_without_a_compiler_the_python_engine_runs_and_rank_0_says_why(tmp_path):
    code, out = _diagnose(2, tmp_path, CXX="/nonexistent/c++")
    assert code == 0 and "RESULT: ok" in out, out[-3000:]
    assert _engines(out, 2) == ["python", "python"], out[-3000:]
    assert out.count(FALLBACK) == 1 and "no C++ compiler '/nonexistent/c++'" in out, out[-3000:]


@pytest.mark.single_process
def test_without_thread_multiple_the_python_engine_runs(tmp_path):
    # MPI_THREAD_SERIALIZED: enough for the Python engine (Python's lock
    # serialises its MPI calls), not for kernels calling MPI on TF's threads.
    code, out = _diagnose(2, tmp_path, MPI4PY_RC_THREAD_LEVEL="serialized")
    assert code == 0 and _engines(out, 2) == ["python", "python"], out[-3000:]
    assert out.count(FALLBACK) == 1 and "without MPI_THREAD_MULTIPLE" in out, out[-3000:]


@pytest.mark.single_process
@pytest.mark.parametrize(
    "value,says",
    [
        ("native", "MPI_STRATEGY_KERNELS=native, but the native kernels are unavailable"),
        ("fast", "MPI_STRATEGY_KERNELS='fast': use 'native', 'python' or 'auto'"),
    ],
)
def test_an_explicit_choice_that_cannot_be_met_fails_every_rank(tmp_path, value, says):
    code, out = _diagnose(2, tmp_path, CXX="/nonexistent/c++", MPI_STRATEGY_KERNELS=value)
    assert code != 0 and "RESULT: FAILED on ranks [0, 1]" in out, out[-3000:]
    assert out.count(says) == 2, out[-3000:]


# Each check of the load-time comparison: what the refusal says when the C++
# header drifted (tests/programs/protocol_drift.py CXX_DRIFTS), and when
# core/protocol.py drifted after the build (PYTHON_DRIFTS).
REFUSALS = {
    "align": ("align.piece: 16 there, 8 here", "align.piece: 8 there, 16 here"),
    "attribute default": ("attr.root: 1 there, 0 here", "attr.root: 0 there, 1 here"),
    "attribute list": ("attr.mpi_op: missing there, 0 here", "attr.extra: missing there, 0 here"),
    "trace layout": ("trace.bytes: 4:int64 there, 3:int64 here", "trace.bytes: 3:int64 there, 4:"),
    "bad-splits layout": (
        "bad_splits.k: 0:int64 there, 1:int64 here",
        "bad_splits.k: 1:int64 there, 0:",
    ),
    "callback": (
        "callback: int32(int64,int64,int64,pointer,int64,text,int32) there",
        ",int64,int64) here",
    ),
    "exports": (
        "mpi_strategy_state_open(int64_t, int)",
        "export.mpi_strategy_state_close: void(int64) there, int64(int64) here",
    ),
    "announcements": (
        "announce.requests(3): 3 there, 4 here",
        "announce.requests(3): 4 there, 5 here",
    ),
}


@pytest.mark.single_process
def test_a_library_of_another_wire_protocol_is_refused_at_load(tmp_path):
    # For each check, one item changed on each side: in the C++ header the
    # kernels were built with (all in one build, each named in its refusal; the
    # library's functions: a build error instead, a C function declared twice,
    # in a build of its own), and in core/protocol.py after they were built.
    def drift(*args):
        argv = [sys.executable, os.path.join(PROGRAMS, "protocol_drift.py"), *map(str, args)]
        result = subprocess.run(argv, capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stdout + result.stderr[-3000:]
        return dict(line.split(": ", 1) for line in result.stdout.splitlines())

    said = {**drift("cxx", tmp_path), **drift("python")}
    assert said["unchanged"] == said["unchanged again"] == "accepted", said
    for check, (cxx, python) in REFUSALS.items():
        for side, says in (("C++", cxx), ("Python", python)):
            if says is not None:
                case = check if side == "Python" or check == "exports" else "compiled"
                told = said[f"{side} side changed ({case})"]
                assert told.startswith(("refused:", "not built:")) and says in told, told
