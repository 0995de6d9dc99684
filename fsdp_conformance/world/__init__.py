"""Running a test in N ranks: reused processes, fresh processes or threads.

Importing this package does not import torch; names resolve on first access. It knows no
FSDP: the FSDP test helpers (``FSDPTest`` ...) live in ``fsdp_conformance.testing`` (also
``fsdp_conformance.FSDPTest``).
"""

from __future__ import annotations

from fsdp_conformance._lazy import lazy_exports

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "InRank": "fsdp_conformance.world.protocol",
    "RankContext": "fsdp_conformance.world.context",
    "current_context": "fsdp_conformance.world.rank_main",
    "Runtime": "fsdp_conformance.world.runtime",
    "RuntimeOptions": "fsdp_conformance.world.runtime",
    "get_runtime": "fsdp_conformance.world.runtime",
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
