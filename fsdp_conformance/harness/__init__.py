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
FSDP (``FSDPTest`` lives in ``fsdp_conformance.testing``). The former module paths
(``world.runtime``, ``world.protocol``, ...; the package was named ``world``) import as aliases (``fsdp_conformance/__init__.py``).
"""

from __future__ import annotations

from fsdp_conformance._lazy import lazy_exports

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "InRank": "fsdp_conformance.harness.wire",
    "RankContext": "fsdp_conformance.harness.context",
    "current_context": "fsdp_conformance.harness.rank",
    "Runtime": "fsdp_conformance.harness.controller",
    "RuntimeOptions": "fsdp_conformance.harness.controller",
    "get_runtime": "fsdp_conformance.harness.controller",
    "RankTestCase": "fsdp_conformance.harness.testcase",
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
