"""The documentation builds, and every code block of README.md and docs/*.md is checked.

The site is built with ``mkdocs build --strict`` (a broken link, anchor or nav
entry fails). Every fenced code block is then checked according to the HTML
comment markers written directly above it (blank lines and several comments
in a row are allowed; docs/contributing.md says the same for doc writers):

``python`` blocks
  no marker / ``<!-- run: python -->``
      run in one process (a one-rank world). The blocks of one page share one
      namespace, in page order, like a notebook; all pages share one process
      (one TensorFlow start-up), each page in its own scratch directory.
  ``<!-- run: mpiexec -n 2 -->``
      the same, on 2 ranks: all such blocks of all pages in one mpiexec launch.
  ``<!-- setup: CODE -->``
      CODE (Python, may span lines) runs just before the block, in its
      namespace: the data or model a fragment needs, kept out of the text.
  ``<!-- file: NAME -->``
      the block is compiled and written to NAME in the page's shell scratch
      directory, where a ``run: shell`` block of the same page must run it.
shell blocks (``bash``, ``sh``, ``shell``, ``console``) need a marker:
  ``<!-- run: shell -->``
      run with ``bash -euo pipefail`` in the page's scratch directory (which
      links ``examples/`` and ``benchmarks/`` and holds the page's ``file:``
      blocks), with a time limit.
  ``<!-- run: slurm -->``
      run the same way, against the test Slurm cluster (testing/slurm_cluster.py,
      2 emulated nodes: fixture ``slurm``): ``SLURM_CONF`` set, ``sbatch``
      waits for its job (``SBATCH_WAIT``) whose output is shown on failure,
      and ``train.py`` (the docs' name for the reader's program) is a stand-in
      that fails unless its ranks form one MPI world spanning every allocated node.
  ``<!-- check: ci -->``
      not run here: each ``&&``-separated command must occur in .ci/run,
      which CI executes (possibly with extra arguments).
  ``<!-- check: launcher -->``
      a dry run of the MPICH launcher: each ``mpiexec`` line runs with its
      program replaced by ``true`` and the hosts of its hostfile (a ``file:``
      block of the page) replaced by ``localhost``, so options and hostfile
      format are checked by the real launcher. Under Open MPI only ``bash -n``.
any block
  ``<!-- check: syntax: REASON -->``
      only compiled (Python) or ``bash -n`` (shell), for what cannot run on
      this machine (srun, PBS, GPUs). REASON is required and printed.
other languages (``text``, ...) must be ``file:`` blocks.

A block without a usable marker fails ``test_every_block_has_a_check``, so new
docs cannot add unchecked code. Failures name the file and line of the block
(tracebacks of Python blocks point into the .md file itself).

The runner of Python blocks is tests/programs/doc_blocks.py.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from mpi_testing import REPO, program
from testing.launch import is_open_mpi, run_launcher, run_mpiexec

pytestmark = pytest.mark.single_process  # launches processes; MPI-independent otherwise

PAGES = [
    "README.md",
    *sorted(
        os.path.join("docs", name)
        for name in os.listdir(os.path.join(REPO, "docs"))
        if name.endswith(".md")
    ),
]
PYTHON_LANGS = {"python", "py"}
SHELL_LANGS = {"bash", "sh", "shell", "console"}
# Scratch directories of shell blocks see these repository directories.
LINKED_DIRS = ["examples", "benchmarks"]
SHELL_SILENCE = 240  # seconds without output: a block that hangs
FAILED = "DOCBLOCK FAILED"  # printed by the runner, tests/programs/doc_blocks.py
RUNNER = program("doc_blocks.py")
# Blocks import mpi_strategy from this checkout, as after `pip install -e .`.
ENV = dict(
    os.environ,
    TF_CPP_MIN_LOG_LEVEL="2",
    PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
)

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)[^`]*$")


class Block:
    def __init__(self, page, line, lang, code, markers):
        self.page, self.line, self.lang, self.code = page, line, lang, code
        self.markers = markers  # [(key, value, line)]

    @property
    def where(self):
        return f"{self.page}:{self.line}"

    def marker(self, key):
        values = [(v, line) for k, v, line in self.markers if k == key]
        return values[-1] if values else (None, None)

    def setups(self):
        return [(v, line) for k, v, line in self.markers if k == "setup"]

    @property
    def mode(self):
        """How this block is checked (see the module docstring), or an error."""
        run, _ = self.marker("run")
        check, _ = self.marker("check")
        file, _ = self.marker("file")
        if sum(x is not None for x in (run, check, file)) > 1:
            return "error: use one of run:, check:, file:"
        if check is not None:
            if check in ("ci", "launcher"):
                return (
                    check
                    if self.lang in SHELL_LANGS
                    else f"error: check: {check} is for shell blocks"
                )
            if check.startswith("syntax:") and check[len("syntax:") :].strip():
                return (
                    "syntax"
                    if self.lang in PYTHON_LANGS | SHELL_LANGS
                    else "error: check: syntax is for python and shell blocks"
                )
            return f"error: unknown check {check!r} (syntax needs a reason: 'syntax: why')"
        if file is not None:
            return "file" if re.fullmatch(r"[\w.-]+", file) else f"error: bad file name {file!r}"
        if self.lang in PYTHON_LANGS:
            if run in (None, "python"):
                return "python"
            if run == "mpiexec -n 2":
                return "mpiexec"
            return f"error: unknown run {run!r} for python (python, mpiexec -n 2)"
        if self.lang in SHELL_LANGS:
            if run in ("shell", "slurm"):
                return run
            return (
                "error: shell blocks need <!-- run: shell -->, <!-- run: slurm --> or a "
                "<!-- check: ... --> marker"
            )
        return f"error: a {self.lang or 'plain'} block must be a <!-- file: NAME --> block"


def parse_page(page):
    """The fenced code blocks of ``page`` (relative to the repository) with their markers."""
    with open(os.path.join(REPO, page)) as f:
        lines = f.read().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = len(m.group("indent")), m.group("fence")
        close = re.compile(rf"^[ \t]*{fence[0]}{{{len(fence)},}}\s*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        code = (
            "\n".join(
                line[indent:] if line[:indent].strip() == "" else line for line in lines[i + 1 : j]
            )
            + "\n"
        )
        blocks.append(Block(page, i + 2, m.group("info").lower(), code, _markers_above(lines, i)))
        i = j + 1
    return blocks


def _markers_above(lines, fence_index):
    """The ``<!-- key: value -->`` comments directly above line ``fence_index``."""
    markers, k = [], fence_index - 1
    while k >= 0:
        if not lines[k].strip():
            k -= 1
            continue
        if not lines[k].rstrip().endswith("-->"):
            break
        start = k
        while start >= 0 and "<!--" not in lines[start]:
            start -= 1
        if start < 0:
            break
        text = "\n".join(lines[start : k + 1])
        body = text[text.index("<!--") + 4 : text.rindex("-->")]
        key, _, value = body.partition(":")
        if key.strip() == "setup":
            # The code keeps its line numbers, so tracebacks point into the page.
            first, _, more = value.partition("\n")
            if first.strip():
                code, line = first.strip() + ("\n" + more if more else ""), start + 1
            else:
                code, line = textwrap.dedent(more), start + 2
            markers.insert(0, ("setup", code.rstrip() + "\n", line))
        else:
            markers.insert(0, (key.strip(), " ".join(value.split()), start + 1))
        k = start - 1
    return markers


def all_blocks():
    return [b for page in PAGES for b in parse_page(page)]


# -- the tests ----------------------------------------------------------------------------------
def _by_mode(mode):
    return [b for b in all_blocks() if b.mode == mode]


def test_every_block_has_a_check():
    blocks = all_blocks()
    assert blocks, "no code blocks found: is the parser broken?"
    errors = [
        f"{b.where}: {b.mode[len('error: ') :]}" for b in blocks if b.mode.startswith("error")
    ]
    for b in blocks:
        if b.mode == "file":
            name = b.marker("file")[0]
            users = [
                s for s in parse_page(b.page) if s.mode in ("shell", "slurm") and name in s.code
            ]
            launchers = [s for s in parse_page(b.page) if s.mode == "launcher" and name in s.code]
            if not users and not launchers:
                errors.append(
                    f"{b.where}: file {name} is used by no run: shell / check: launcher "
                    "block of the same page, so nothing checks it"
                )
        if b.setups() and b.mode not in ("python", "mpiexec"):
            errors.append(f"{b.where}: setup: only applies to python blocks that run")
    assert not errors, "code blocks without a working check:\n" + "\n".join(errors)


def test_site_builds_strict(tmp_path):
    # --strict turns every warning (broken link or anchor, page missing from the
    # nav, a docstring mkdocstrings cannot render) into a failure.
    code, out = run_launcher(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--clean",
            "-f",
            os.path.join(REPO, "mkdocs.yml"),
            "-d",
            str(tmp_path / "site"),
        ],
        cwd=REPO,
    )
    assert code == 0, f"mkdocs build --strict failed:\n{out}"
    for page in PAGES:
        name = "readme" if page == "README.md" else os.path.splitext(os.path.basename(page))[0]
        site_page = tmp_path / "site" / ("" if name == "index" else name) / "index.html"
        assert site_page.exists(), f"{page} did not become {site_page}"
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    import mpi_strategy

    for name in mpi_strategy.__all__:
        assert f'id="mpi_strategy.{name}"' in api, f"docs/api.md does not document {name}"


def test_the_index_lists_every_page():
    """docs/index.md links every page of docs/, so that no page is found only by search."""
    with open(os.path.join(REPO, "docs", "index.md")) as f:
        linked = set(re.findall(r"\]\(([\w.-]+\.md)(?:#[\w-]*)?\)", f.read()))
    pages = {os.path.basename(page) for page in PAGES if page.startswith("docs")}
    missing = sorted(pages - linked - {"index.md"})
    assert not missing, f"docs/index.md does not list {missing}: add a line on what each is for"


def _payload(tmp_path, mode):
    pages = {}
    for b in _by_mode(mode):
        page = pages.setdefault(
            b.page,
            {"page": b.page, "blocks": [], "cwd": str(tmp_path / re.sub(r"\W", "_", b.page))},
        )
        page["blocks"].append({"line": b.line, "code": b.code, "setups": b.setups()})
    path = tmp_path / f"{mode}.json"
    path.write_text(json.dumps({"pages": list(pages.values())}))
    return path, len([b for p in pages.values() for b in p["blocks"]])


def _explain(out):
    """The failing blocks first, then the end of the output."""
    clean = re.sub(r"\[\d+\] ?", "", out)
    failed = [line for line in clean.splitlines() if line.startswith(FAILED)]
    started = [line for line in clean.splitlines() if line.startswith("DOCBLOCK START")]
    head = "\n".join(failed) or (
        f"last block started: {started[-1].split()[-1]}" if started else ""
    )
    return f"{head}\n--- output ---\n{clean[-12000:]}"


def test_python_blocks_run_in_one_process(tmp_path):
    payload, count = _payload(tmp_path, "python")
    if count == 0:
        pytest.skip("no single-process python blocks in the docs")
    try:
        code, out = run_launcher([sys.executable, RUNNER, str(payload)], cwd=REPO, env=ENV)
    except AssertionError as timeout:  # (run_launcher's, with the output so far)
        raise AssertionError("running the python blocks: " + _explain(str(timeout))) from None
    assert code == 0, _explain(out)


def test_python_blocks_run_on_two_ranks(tmp_path):
    payload, count = _payload(tmp_path, "mpiexec")
    assert count > 0
    code, out = run_mpiexec(
        2,
        [sys.executable, RUNNER, str(payload)],
        silence=300,
        cwd=REPO,
        env={"PYTHONPATH": ENV["PYTHONPATH"]},
    )
    assert code == 0, _explain(out)


def _scratch(tmp_path, page):
    """The page's shell directory: repository examples linked, the page's file: blocks written."""
    where = tmp_path / re.sub(r"\W", "_", page)
    where.mkdir(exist_ok=True)
    for name in LINKED_DIRS:
        if not (where / name).exists():
            os.symlink(os.path.join(REPO, name), where / name)
    for b in parse_page(page):
        if b.mode == "file":
            if b.lang in PYTHON_LANGS:
                compile(b.code, b.where, "exec")  # a SyntaxError names the block
            (where / b.marker("file")[0]).write_text(b.code)
    return where


def _run_bash(code, cwd, silence=SHELL_SILENCE, extra_env=None):
    """(exit status, output) of bash running ``code``; (None, output so far)
    once it printed nothing for ``silence`` seconds (then killed, with mpiexec
    and its ranks)."""
    env = dict(ENV, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.update(extra_env or {})
    try:
        return run_launcher(["bash", "-euo", "pipefail", "-c", code], silence, env, str(cwd))
    except AssertionError as timeout:  # (run_launcher's, with the output so far)
        return None, str(timeout)


@pytest.mark.slow("every shell block of the docs runs as a user would type it")
def test_shell_blocks_run(tmp_path):
    blocks = _by_mode("shell")
    failures = []
    for b in blocks:
        code, out = _run_bash(b.code, _scratch(tmp_path, b.page))
        if code != 0:
            status = "TIMEOUT" if code is None else f"exit status {code}"
            out = re.sub(r"\[\d+\] ?", "", out)[-5000:]
            failures.append(f"{FAILED} {b.where} ({status}):\n{b.code}{out}")
    assert not failures, "\n\n".join(failures)


# The reader's program in `run: slurm` blocks: one MPI world of all the tasks.
SLURM_TRAIN_STAND_IN = """
import os, socket
from mpi4py import MPI
world = MPI.COMM_WORLD
hosts, nodes = set(world.allgather(socket.gethostname())), int(os.environ["SLURM_JOB_NUM_NODES"])
assert world.Get_size() > 1 and len(hosts) == nodes, f"{world.Get_size()} rank(s) on {hosts}"
"""


def test_slurm_blocks_run_on_the_test_cluster(tmp_path, slurm):
    if slurm.n_nodes < 2:
        pytest.skip(slurm.multi_node_skip)
    env = {**slurm.env(), **slurm.mpi_env(), "SBATCH_WAIT": "1"}
    failures = []
    for b in _by_mode("slurm"):
        where = _scratch(tmp_path, b.page)
        (where / "train.py").write_text(SLURM_TRAIN_STAND_IN)
        code, out = _run_bash(b.code, where, extra_env=env)
        if code != 0:
            for job_output in sorted(where.glob("slurm-*.out")):
                out += f"\n--- {job_output.name} ---\n{job_output.read_text()}"
            status = "TIMEOUT" if code is None else f"exit status {code}"
            failures.append(f"{FAILED} {b.where} ({status}):\n{b.code}{out[-5000:]}")
    assert not failures, "\n\n".join(failures)


def _commands(code):
    """The commands of a shell block: comment lines dropped, continuations joined."""
    text = re.sub(r"\\\n\s*", " ", code)
    return [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def test_ci_runs_the_ci_blocks():
    with open(os.path.join(REPO, ".ci", "run")) as f:
        ci = f.read()
    missing = [
        f"{b.where}: {part.strip()}"
        for b in _by_mode("ci")
        for cmd in _commands(b.code)
        for part in cmd.split("&&")
        if part.strip() not in ci
    ]
    assert not missing, "commands marked check: ci that .ci/run does not run:\n" + "\n".join(
        missing
    )


def _localhost_hostfile(text):
    """A hostfile with every host replaced by localhost (MPICH `host[:n]` lines)."""
    out = []
    for line in text.splitlines():
        entry = line.split("#")[0].strip()
        if entry:
            _host, _, count = entry.partition(":")
            out.append("localhost" + (f":{count}" if count else ""))
    return "\n".join(out) + "\n"


def test_launcher_blocks_dry_run(tmp_path):
    failures = []
    for b in _by_mode("launcher"):
        where = _scratch(tmp_path, b.page)
        if is_open_mpi():
            # This dry run needs MPICH's hydra; with Open MPI check the syntax only.
            code, out = _run_bash(f"bash -n <<'EOF'\n{b.code}EOF\n", where, silence=30)
            if code != 0:
                failures.append(f"{b.where}: {out}")
            continue
        for cmd in _commands(b.code):
            argv = cmd.split()
            if argv[0] != "mpiexec" or "python" not in argv:
                failures.append(
                    f"{b.where}: check: launcher lines must be `mpiexec ... python ...`: {cmd}"
                )
                continue
            argv = [*argv[: argv.index("python")], "true"]
            for flag in ("-f", "-hostfile", "--hostfile", "-machinefile"):
                if flag in argv:
                    name = argv[argv.index(flag) + 1]
                    src = where / name
                    if not src.exists():
                        failures.append(f"{b.where}: hostfile {name} is no file: block of the page")
                        break
                    local = where / (name + ".localhost")
                    local.write_text(_localhost_hostfile(src.read_text()))
                    argv[argv.index(flag) + 1] = str(local)
            else:
                code, out = _run_bash(" ".join(argv), where, silence=60)
                if code != 0:
                    failures.append(
                        f"{FAILED} {b.where}: `{' '.join(argv)}` (dry run of `{cmd}`):\n{out}"
                    )
    assert not failures, "\n\n".join(failures)


def test_syntax_only_blocks(tmp_path):
    """Blocks that cannot run on this machine: checked for syntax only, and listed."""
    failures = []
    for b in _by_mode("syntax"):
        reason = b.marker("check")[0][len("syntax:") :].strip()
        print(f"syntax only: {b.where} ({reason})")
        if b.lang in PYTHON_LANGS:
            try:
                compile("\n" * (b.line - 1) + b.code, b.page, "exec")
            except SyntaxError as exc:
                failures.append(f"{b.where}: {exc}")
        else:
            script = tmp_path / "block.sh"
            script.write_text(b.code)
            out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
            if out.returncode != 0:
                failures.append(f"{b.where}: {out.stderr}")
    assert not failures, "\n".join(failures)
