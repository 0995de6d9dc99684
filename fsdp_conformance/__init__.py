"""fsdp-conformance: a conformance suite for Fully Sharded Data Parallel implementations.

Importing it imports no torch: the public names resolve on first access.
"""

from __future__ import annotations

from fsdp_conformance._lazy import lazy_exports

_TESTING = ("FSDPTest", "FSDPInitMode", "DummyProcessGroup", "get_full_params")
_ADAPTERS = ("Adapter", "ALL_FEATURES", "Deviation", "Feature", "InstanceState", "RootState")
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(_TESTING, "fsdp_conformance.testing"),  # docs/harness.md
    "InRank": "fsdp_conformance.harness",
    "RankContext": "fsdp_conformance.harness",
    **dict.fromkeys(_ADAPTERS, "fsdp_conformance.adapters"),  # docs/adapters.md
    "UnsupportedFeatureError": "fsdp_conformance.adapters",
    "get_adapter": "fsdp_conformance.adapters",
    "DeviceHandle": "fsdp_conformance.device_handle",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
