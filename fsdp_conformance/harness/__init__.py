"""The harness: runs one test body in N ranks (reused processes, fresh processes, threads, or
the processes of a torchrun job), laid out by process role (docs/harness.md). Importing it does
not import torch; names resolve on first access. It knows no FSDP (``FSDPTest`` lives in
``fsdp_conformance.testing``).
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

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
