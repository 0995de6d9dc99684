"""Compatibility path: the FSDP test helpers live in ``fsdp_conformance.testing``.

``world/`` runs functions in N ranks and knows no FSDP; ``FSDPTest``, ``FSDPInitMode``,
``DummyProcessGroup``, ``get_full_params``, ``get_cycles_per_ms`` and ``device_sleep`` moved to
``fsdp_conformance.testing`` (the rank test case itself is ``world.testcase.RankTestCase``).
The names resolve there on first access.
"""

from __future__ import annotations

from fsdp_conformance._lazy import lazy_exports

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    name: "fsdp_conformance.testing"
    for name in (
        "DummyProcessGroup",
        "FSDPInitMode",
        "FSDPTest",
        "device_sleep",
        "get_cycles_per_ms",
        "get_full_params",
    )
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
