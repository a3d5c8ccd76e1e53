"""The architecture holds: layers import only downward, no import cycles, every
private TensorFlow hook the binding overrides is listed in the compat boundary,
and every process-wide effect is in the docs' table.

Run at 1 rank only (nothing here communicates).
"""

import os
import re
import shutil
import subprocess
import sys

import grimp
import pytest
import tensorflow as tf

from mpi_strategy._src import _tf_internal, effects
from mpi_strategy._src.distribute.cross_device_ops import MPICrossDeviceOps
from mpi_strategy._src.distribute.strategy import MPIExtended, MPIStrategy

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.single_process


def test_the_import_contracts_hold():
    """The layers (.importlinter): a new upward import fails here."""
    lint = shutil.which("lint-imports") or os.path.join(
        os.path.dirname(sys.executable), "lint-imports"
    )
    result = subprocess.run([lint, ".importlinter"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_no_module_of_the_package_takes_part_in_an_import_cycle():
    graph = grimp.build_graph("mpi_strategy", cache_dir=None)
    cycles = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            if graph.chain_exists(importer=imported, imported=importer):
                cycles.append(f"{importer} -> {imported} -> ... -> {importer}")
    # (a package's __init__ importing its own modules is not a cycle of the design)
    cycles = [c for c in cycles if not re.match(r"(\S+) -> \1\.", c)]
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize(
    "cls, base",
    [
        (MPIExtended, _tf_internal.MirroredExtended),
        (MPICrossDeviceOps, tf.distribute.CrossDeviceOps),
        (MPIStrategy, tf.distribute.Strategy),
    ],
)
def test_every_overridden_private_hook_is_listed_in_the_compat_boundary(cls, base):
    listed = {name for names in _tf_internal.OVERRIDDEN_HOOKS.values() for name in names}
    overridden = {
        name
        for name in vars(cls)
        if name.startswith("_") and not name.startswith("__") and hasattr(base, name)
    }
    assert overridden <= listed, f"not in _tf_internal.OVERRIDDEN_HOOKS: {overridden - listed}"


def test_every_process_wide_effect_is_in_the_docs_table():
    with open(os.path.join(REPO, "docs", "concepts.md")) as f:
        text = f.read()
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    for effect in effects.EFFECTS:
        assert f"| {effect.what} | {effect.why} | {effect.acts} |" in rows, effect
    documented = [r for r in rows if r.count("|") == 4 and "what is replaced" not in r]
    section = text.split("## Process-wide effects", 1)[1].split("\n## ", 1)[0]
    in_section = [r for r in documented if r in section and not r.startswith("| ---")]
    assert len(in_section) == len(effects.EFFECTS), in_section


def test_install_replaces_each_listed_call_once_and_uninstall_puts_every_original_back():
    from tensorflow.python.checkpoint import checkpoint

    effects.install()  # adapts what was imported since (e.g. tf_keras, by earlier tests)
    installed = effects.installed()
    assert "tensorflow.python.checkpoint.checkpoint.Checkpoint._write" in installed
    assert len(installed) == len(set(installed))
    wrapped = checkpoint.Checkpoint._write
    effects.install()  # idempotent: nothing is wrapped twice
    assert checkpoint.Checkpoint._write is wrapped
    try:
        effects.uninstall()
        assert effects.installed() == []
        assert not hasattr(checkpoint.Checkpoint._write, "__wrapped__")
    finally:
        effects.install()
    assert effects.installed() == installed


def _importlinter_layers() -> list[set[str]]:
    """The layers of .importlinter's first contract, top first (a set per level)."""
    with open(os.path.join(REPO, ".importlinter")) as f:
        text = f.read()
    block = text.split("[importlinter:contract:layers]", 1)[1].split("layers =", 1)[1]
    levels = []
    for line in block.splitlines()[1:]:
        if not line.startswith((" ", "\t")) or not line.strip():
            break
        levels.append({name.strip() for name in line.split("|")})
    return levels


def test_the_docs_list_the_layers_in_the_order_of_importlinter():
    """The layer order is written once (.importlinter); docs/concepts.md's
    "Layers" table lists the folders top to bottom and must follow it."""
    with open(os.path.join(REPO, "docs", "concepts.md")) as f:
        section = f.read().split("## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`_src/" in line]
    listed = [
        name for row in rows for name in re.findall(r"`_src/(\w+)(?:\.py|/)`", row.split(" | ")[1])
    ]
    levels = _importlinter_layers()
    expected = [name for level in levels for name in sorted(level)]
    assert sorted(listed) == sorted(expected), (listed, expected)
    position = {name: i for i, level in enumerate(levels) for name in level}
    assert [position[name] for name in listed] == sorted(position[name] for name in listed), listed


# Module-level names that hold something mutable but are not process state:
# the registry of agreement kinds (filled at import, alike on every rank, then
# only read), what each thread sees alone (the save under way), and Horovod's
# public global process set (an object Horovod's API exports by identity).
_NOT_PROCESS_STATE = {
    "core/kinds.py": {"_BY_CODE"},
    "features/saving/write_point.py": {"_local"},  # per thread: the save under way
    "distribute/sharding.py": {"_local"},  # per thread: a sharded slot being made
    "horovod/basics.py": {"global_process_set"},
}
_MUTABLE_CALLS = {"dict", "list", "set", "count", "WeakSet", "WeakKeyDictionary", "local"}


def _module_state(path: str) -> list[str]:
    """Module-level names that hold process state: bound to an empty
    container (filled later), to a mutable container or counter under a name
    that is not an ALL_CAPS constant, or rebound by a ``global`` statement."""
    import ast

    with open(path) as f:
        tree = ast.parse(f.read())
    found = {n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        value = getattr(node, "value", None)
        call = value.func if isinstance(value, ast.Call) else None
        called = getattr(call, "attr", getattr(call, "id", None))
        empty = (
            (isinstance(value, ast.Dict) and not value.keys)
            or (isinstance(value, (ast.List, ast.Set)) and not value.elts)
            or (
                isinstance(value, ast.Call) and called in {"dict", "list", "set"} and not value.args
            )
        )
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set)) or called in _MUTABLE_CALLS
        for target in targets:
            if not isinstance(target, ast.Name) or target.id == "__all__":
                continue
            if empty or (mutable and not target.id.isupper()):
                found.add(target.id)
    return sorted(found)


def test_the_process_state_lives_in_one_object():
    """core/process.py's PROCESS holds every per-process state; a module that
    keeps its own (a ``_state`` dict, a registry, a counter) fails here."""
    src = os.path.join(REPO, "mpi_strategy", "_src")
    holders = []
    for folder, _, files in os.walk(src):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, src)
            allowed = _NOT_PROCESS_STATE.get(relative, set())
            holders += [f"{relative}: {n}" for n in _module_state(path) if n not in allowed]
    assert holders == [], holders
