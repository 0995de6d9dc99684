"""Running a test in N ranks: reused processes, fresh processes or threads.

Importing this package does not import torch; names resolve on first access.
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
    # the FSDP test helpers (old paths; they live in fsdp_conformance.testing)
    "FSDPTest": "fsdp_conformance.testing",
    "FSDPInitMode": "fsdp_conformance.testing",
    "DummyProcessGroup": "fsdp_conformance.testing",
    "get_full_params": "fsdp_conformance.testing",
    "get_cycles_per_ms": "fsdp_conformance.testing",
    "device_sleep": "fsdp_conformance.testing",
}

__all__ = [
    "DummyProcessGroup",
    "FSDPInitMode",
    "FSDPTest",
    "InRank",
    "RankContext",
    "RankTestCase",
    "Runtime",
    "RuntimeOptions",
    "current_context",
    "device_sleep",
    "get_cycles_per_ms",
    "get_full_params",
    "get_runtime",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
