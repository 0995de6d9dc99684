"""The harness: runs one test body in N ranks (reused processes, fresh processes, threads, or
the processes of a torchrun job), laid out by process role:

- ``controller``: the pytest side; options, choice of backend and GPUs, the rank backends
  behind one interface, the verdict combined from the ranks' outcomes;
- ``rankset``: N rank processes, spawned, reused and torn down by the controller;
- ``rank``: the rank task every mode runs, and a rank process's entry point;
- ``wire``: the messages between controller and rank processes;
- ``threads``: thread ranks; ``launcher``: the in-place ranks of a torchrun job;
- shared by the roles: ``context`` (``dist``), ``collectives``, ``isolation``, ``gpus``,
  ``properties``, ``signals``, ``testcase`` (``RankTestCase``), ``extras``.

Importing this package does not import torch; names resolve on first access. It knows no
FSDP (``FSDPTest`` lives in ``fsdp_conformance.testing``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types

from fsdp_conformance._lazy import lazy_exports

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "InRank": "fsdp_conformance.world.wire",
    "RankContext": "fsdp_conformance.world.context",
    "current_context": "fsdp_conformance.world.rank",
    "Runtime": "fsdp_conformance.world.controller",
    "RuntimeOptions": "fsdp_conformance.world.controller",
    "get_runtime": "fsdp_conformance.world.controller",
    "RankTestCase": "fsdp_conformance.world.testcase",
}

__all__ = [
    "InRank",
    "RankContext",
    "RankTestCase",
    "Runtime",
    "RuntimeOptions",
    "current_context",
    "get_runtime",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

# Earlier module paths, still importable: old name -> the module that holds its names now
_MOVED = {
    "runtime": "controller",
    "report": "controller",
    "protocol": "wire",
    "execute": "rank",
    "rank_main": "rank",
    "hooks": "rank",
    "procs": "rankset",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``fsdp_conformance.world.<old name>`` as the module of its new name."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> object:
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(f"{__name__}.{_MOVED[spec.name.rpartition('.')[2]]}")
        spec.loader_state = module.__spec__  # the import machinery overwrites it; put back
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
