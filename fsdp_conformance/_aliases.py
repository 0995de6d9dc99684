"""Old import paths of moved modules: an old name gives the very module object of the new one
(so ``isinstance`` and pickling agree), and ``python -m`` runs the new file. Torch-free.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import CodeType, ModuleType

MOVED: dict[str, str] = {}  # old module (or package prefix) -> new


def _target(name: str) -> str | None:
    """Where old module ``name`` lives now (the longest moved prefix decides), or None."""
    olds = [old for old in MOVED if name == old or name.startswith(old + ".")]
    old = max(olds, key=len, default=None)
    return None if old is None else MOVED[old] + name[len(old) :]


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # executed under its own name already; the import system set __spec__ to the alias's
        module.__spec__ = self.spec

    def get_code(self, name: str) -> CodeType | None:  # what `python -m old.name` runs
        spec = importlib.util.find_spec(self.target)
        return spec.loader.get_code(self.target) if spec and spec.loader else None


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object = None, target: object = None):  # noqa: ANN201
        new = _target(name)
        return None if new is None else importlib.util.spec_from_loader(name, _AliasLoader(new))


def install(moved: dict[str, str]) -> None:
    """Serve each old path of ``moved`` (old -> new, a module or a package prefix)."""
    MOVED.update(moved)
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())
