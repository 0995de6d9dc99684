"""Adapters: how the conformance suite drives one FSDP implementation (docs/adapters.md).

`get_adapter(name)` with "impl", "torch-fsdp1", "torch-fsdp2" or "pkg.module:ATTR"; the
protocol is `Adapter` (base.py), feature names are `Feature` (features.py), canonical states are
`InstanceState` / `RootState` (fsdp_conformance/training_states.py). See docs/adapters.md.
"""

from __future__ import annotations

from fsdp_conformance.device_handle import DeviceHandle
from fsdp_conformance.training_states import (
    LEGAL_INSTANCE_TRANSITIONS,
    LEGAL_ROOT_TRANSITIONS,
    InstanceState,
    RootState,
)

from .base import (
    Adapter,
    AdapterWrap,
    FeatureNotImplementedError,
    ObserverRegistry,
    UnsupportedFeatureError,
    clean_param_name,
)
from .deviations import CHECK_IDS, Deviation
from .features import (
    ALL_FEATURES,
    ALWAYS_WRAP,
    Feature,
    MixedPrecisionConfig,
    module_predicate,
    normalize_config,
)
from .registry import BUILTIN_ADAPTERS, get_adapter

__all__ = [
    "ALL_FEATURES",
    "ALWAYS_WRAP",
    "BUILTIN_ADAPTERS",
    "CHECK_IDS",
    "LEGAL_INSTANCE_TRANSITIONS",
    "LEGAL_ROOT_TRANSITIONS",
    "Adapter",
    "AdapterWrap",
    "Deviation",
    "DeviceHandle",
    "Feature",
    "FeatureNotImplementedError",
    "InstanceState",
    "MixedPrecisionConfig",
    "ObserverRegistry",
    "RootState",
    "UnsupportedFeatureError",
    "clean_param_name",
    "get_adapter",
    "module_predicate",
    "normalize_config",
]
