"""fsdp-conformance: a conformance suite for Fully Sharded Data Parallel implementations.

Importing it imports no torch: the public names resolve on first access.
"""

from __future__ import annotations

from fsdp_conformance import _aliases
from fsdp_conformance._lazy import lazy_exports

# old import paths of moved public modules (the same module objects; python -m included)
_aliases.install(
    {
        "fsdp_conformance.fuzz": "fsdp_conformance.suite.fuzz",
        "fsdp_conformance.world": "fsdp_conformance.harness",
        "fsdp_conformance.world.runtime": "fsdp_conformance.harness.controller",
        "fsdp_conformance.world.report": "fsdp_conformance.harness.controller",
        "fsdp_conformance.world.protocol": "fsdp_conformance.harness.wire",
        "fsdp_conformance.world.execute": "fsdp_conformance.harness.rank",
        "fsdp_conformance.world.rank_main": "fsdp_conformance.harness.rank",
        "fsdp_conformance.world.hooks": "fsdp_conformance.harness.rank",
        "fsdp_conformance.world.procs": "fsdp_conformance.harness.rankset",
        "fsdp_conformance.vocab": "fsdp_conformance.constants",
        "fsdp_conformance.adapters.states": "fsdp_conformance.training_states",
        "fsdp_conformance.cli.collect": "fsdp_conformance.cli.records",
        "fsdp_conformance.cli.common": "fsdp_conformance.cli.usage",
        "fsdp_conformance.cli.overlap": "fsdp_conformance.cli.overlap_table",
        "fsdp_conformance.models.common": "fsdp_conformance.models.model_base",
        "fsdp_conformance.models.overlap": "fsdp_conformance.models.layer",
        "fsdp_conformance.models.delayed": "fsdp_conformance.models.with_delay",
    }
)

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
