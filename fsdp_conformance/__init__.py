"""fsdp-conformance: a conformance suite for Fully Sharded Data Parallel implementations.

Importing this package does not import torch (the pytest plugin imports it at
pytest start-up); the public names are resolved on first attribute access.
"""
from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # running a test in N ranks (docs/harness.md)
    "FSDPTest": "fsdp_conformance.world",
    "FSDPInitMode": "fsdp_conformance.world",
    "DummyProcessGroup": "fsdp_conformance.world",
    "get_full_params": "fsdp_conformance.world",
    "InRank": "fsdp_conformance.world",
    "RankContext": "fsdp_conformance.world",
    # driving an FSDP implementation (docs/adapters.md)
    "Adapter": "fsdp_conformance.adapters",
    "Feature": "fsdp_conformance.adapters",
    "get_adapter": "fsdp_conformance.adapters",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fsdp_conformance' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
