"""fsdp-conformance: a conformance suite for Fully Sharded Data Parallel implementations.

Importing this package does not import torch (the pytest plugin imports it at
pytest start-up); the public names are resolved on first attribute access.
"""

from __future__ import annotations

from fsdp_conformance import _aliases
from fsdp_conformance._lazy import lazy_exports

# old import paths of moved public modules (the same module objects; python -m included)
_aliases.install(
    {
        # the fuzzer, now part of the suite (repro.py files written before import the old name)
        "fsdp_conformance.fuzz": "fsdp_conformance.suite.fuzz",
        # the harness, named `world` before, and its modules before the process-role layout
        "fsdp_conformance.world": "fsdp_conformance.harness",
        "fsdp_conformance.world.runtime": "fsdp_conformance.harness.controller",
        "fsdp_conformance.world.report": "fsdp_conformance.harness.controller",
        "fsdp_conformance.world.protocol": "fsdp_conformance.harness.wire",
        "fsdp_conformance.world.execute": "fsdp_conformance.harness.rank",
        "fsdp_conformance.world.rank_main": "fsdp_conformance.harness.rank",
        "fsdp_conformance.world.hooks": "fsdp_conformance.harness.rank",
        "fsdp_conformance.world.procs": "fsdp_conformance.harness.rankset",
        # modules renamed so that no two share a file name
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

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # running a test in N ranks (docs/harness.md)
    "FSDPTest": "fsdp_conformance.testing",
    "FSDPInitMode": "fsdp_conformance.testing",
    "DummyProcessGroup": "fsdp_conformance.testing",
    "get_full_params": "fsdp_conformance.testing",
    "InRank": "fsdp_conformance.harness",
    "RankContext": "fsdp_conformance.harness",
    # driving an FSDP implementation (docs/adapters.md)
    "Adapter": "fsdp_conformance.adapters",
    "ALL_FEATURES": "fsdp_conformance.adapters",
    "DeviceHandle": "fsdp_conformance.device_handle",
    "Deviation": "fsdp_conformance.adapters",
    "Feature": "fsdp_conformance.adapters",
    "InstanceState": "fsdp_conformance.adapters",
    "RootState": "fsdp_conformance.adapters",
    "UnsupportedFeatureError": "fsdp_conformance.adapters",
    "get_adapter": "fsdp_conformance.adapters",
}

__all__ = [
    "ALL_FEATURES",
    "Adapter",
    "Deviation",
    "DeviceHandle",
    "DummyProcessGroup",
    "FSDPInitMode",
    "FSDPTest",
    "Feature",
    "InRank",
    "InstanceState",
    "RankContext",
    "RootState",
    "UnsupportedFeatureError",
    "get_adapter",
    "get_full_params",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
