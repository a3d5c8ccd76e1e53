"""``horovod`` as a name for ``mpi_strategy.horovod``: what lets a Horovod
program run unchanged (``python -m mpi_strategy.horovod train.py``)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence

PUBLIC = "mpi_strategy.horovod"


def real_horovod() -> str | None:
    """Where the real ``horovod`` package is installed, or None."""
    spec = importlib.util.find_spec("horovod")
    if spec is None or spec.name == PUBLIC:
        return None
    return str(spec.origin or list(spec.submodule_search_locations or []))


class _Loader(importlib.abc.Loader):
    """Hands out the ``mpi_strategy.horovod`` module itself (one module object
    under both names), keeping its own ``__spec__``."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.original: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self.target)
        self.original = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = self.original  # (importlib set the alias's spec)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "horovod" and not fullname.startswith("horovod."):
            return None
        public = PUBLIC + fullname[len("horovod") :]
        if importlib.util.find_spec(public) is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Loader(public))


def install() -> None:
    """Makes ``import horovod.X`` import ``mpi_strategy.horovod.X`` (the same
    module objects), for the rest of this process."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
