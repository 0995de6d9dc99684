"""Adapters: how the suite drives one FSDP implementation (docs/adapters.md): `get_adapter`,
the protocol `Adapter` and what it declares, `Declarations`; negotiation in `features`,
deviation matching in `deviations`, training-loop hooks in `loop`."""

from __future__ import annotations

from fsdp_conformance.device_handle import DeviceHandle
from fsdp_conformance.training_states import (
    LEGAL_INSTANCE_TRANSITIONS,
    LEGAL_ROOT_TRANSITIONS,
    InstanceState,
    RootState,
)

from . import _compat, deviations, features, loop  # noqa: F401  (_compat: older members)
from .base import Adapter, AdapterWrap, ObserverRegistry, clean_param_name
from .deviations import CHECK_IDS, Deviation
from .features import (
    ALL_FEATURES,
    ALWAYS_WRAP,
    Declarations,
    Feature,
    FeatureNotImplementedError,
    MixedPrecisionConfig,
    UnsupportedFeatureError,
    module_predicate,
    normalize_config,
)
from .loop import EngineHooks
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
    "Declarations",
    "Deviation",
    "DeviceHandle",
    "EngineHooks",
    "Feature",
    "FeatureNotImplementedError",
    "InstanceState",
    "MixedPrecisionConfig",
    "ObserverRegistry",
    "RootState",
    "UnsupportedFeatureError",
    "clean_param_name",
    "deviations",
    "features",
    "get_adapter",
    "loop",
    "module_predicate",
    "normalize_config",
]
