"""testing/launch.py tells a hang from a slow machine: a launch is killed after
``silence`` seconds without output, however long it runs while it prints.

Plain commands (no mpiexec needed): ``run_launcher`` treats any command line
as the launcher's.
"""

import os
import sys
import textwrap
import time

import pytest

from testing import launch
from testing.launch import run_launcher

SILENCE = 3.0  # seconds: well above a Python start-up, even on a loaded machine


def _python(code):
    return [sys.executable, "-c", textwrap.dedent(code)]


@pytest.mark.single_process
def test_a_command_that_keeps_printing_runs_past_the_silence_limit():
    # Lines, then output without a newline (pytest -q's progress dots, as each
    # rank of a suite rerun prints them), each phase longer than the limit.
    lines = []
    started = time.monotonic()
    code, out = run_launcher(
        _python("""
        import sys, time
        for i in range(8):  # 4 s, a line every 0.5 s
            print("line", i, flush=True)
            time.sleep(0.5)
        for i in range(10):  # 5 s, a dot every 0.5 s
            sys.stdout.write("."); sys.stdout.flush()
            time.sleep(0.5)
        """),
        silence=SILENCE,
        each_line=lines.append,
    )
    took = time.monotonic() - started
    assert code == 0 and took > 2 * SILENCE, (code, took, out)
    assert out.splitlines() == [f"line {i}" for i in range(8)] + ["." * 10], out
    assert lines == [f"line {i}\n" for i in range(8)] + ["." * 10]


@pytest.mark.single_process
def test_a_command_that_goes_silent_is_killed_after_the_silence_limit():
    started = time.monotonic()
    with pytest.raises(AssertionError) as raised:
        run_launcher(
            _python("""
            import os, time
            print("child pid", os.getpid(), "waiting forever", flush=True)
            time.sleep(600)
            """),
            silence=SILENCE,
        )
    took = time.monotonic() - started
    message = str(raised.value)
    assert f"no output for {SILENCE:g} s" in message, message
    assert "waiting forever" in message, message  # the output so far
    # Killed after the limit, not before; and well before the command's end.
    assert SILENCE <= took < SILENCE + 30, took
    pid = int(message.split("child pid ")[1].split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed with its process group, not left behind


@pytest.mark.single_process
def test_an_overall_limit_stops_even_a_command_that_keeps_printing():
    started = time.monotonic()
    with pytest.raises(AssertionError) as raised:
        run_launcher(
            _python("""
            import time
            while True:
                print("still busy", flush=True)
                time.sleep(0.5)
            """),
            silence=2 * SILENCE,
            total=SILENCE,
        )
    took = time.monotonic() - started
    assert "overall limit of 3 s" in str(raised.value) and "still busy" in str(raised.value)
    assert SILENCE <= took < SILENCE + 30, took


@pytest.mark.single_process
def test_mpich_ranks_beyond_the_cores_wait_politely(monkeypatch):
    # (docs/launching.md, "More ranks than cores"; Open MPI yields by itself)
    monkeypatch.setattr(launch, "is_open_mpi", lambda: False)
    monkeypatch.setattr(launch, "_LAUNCHED", launch._Launched())  # (none running)
    cores = len(os.sched_getaffinity(0))
    assert launch.mpiexec_env(cores) == {}
    assert launch.mpiexec_env(cores + 1) == launch.MPICH_OVERSUBSCRIBED_ENV
    launch._LAUNCHED.add(1)  # beside a running launch of this process
    assert launch.mpiexec_env(cores) == launch.MPICH_OVERSUBSCRIBED_ENV
    launch._LAUNCHED.add(-1)
    assert launch.polite_env() == launch.MPICH_OVERSUBSCRIBED_ENV  # (beside others: any size)
    monkeypatch.setenv("MPIR_CVAR_POLLS_BEFORE_YIELD", "1000")  # a user's own choice stays
    assert launch.mpiexec_env(cores + 1)["MPIR_CVAR_POLLS_BEFORE_YIELD"] == "1000"
    assert launch.polite_env()["MPIR_CVAR_POLLS_BEFORE_YIELD"] == "1000"
