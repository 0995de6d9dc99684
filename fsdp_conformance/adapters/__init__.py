"""Adapters: how the suite drives one FSDP implementation (docs/adapters.md): `get_adapter`,
the protocol `Adapter` (its training-loop hooks included) and what it declares,
`Declarations`; negotiation in `features`, deviation matching in `deviations`."""

from __future__ import annotations

from fsdp_conformance.device_handle import DeviceHandle
from fsdp_conformance.training_states import (
    LEGAL_INSTANCE_TRANSITIONS,
    LEGAL_ROOT_TRANSITIONS,
    InstanceState,
    RootState,
)

from . import deviations, features
from ._removed import REMOVED_EXPORTS, removed_export
from .base import Adapter, AdapterWrap, ObserverRegistry, clean_param_name
from .deviations import Deviation, Envelope
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
from .registry import BUILTIN_ADAPTERS, get_adapter

__all__ = [
    "ALL_FEATURES",
    "ALWAYS_WRAP",
    "BUILTIN_ADAPTERS",
    "LEGAL_INSTANCE_TRANSITIONS",
    "LEGAL_ROOT_TRANSITIONS",
    "Adapter",
    "AdapterWrap",
    "Declarations",
    "Deviation",
    "DeviceHandle",
    "Envelope",
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
    "module_predicate",
    "normalize_config",
]


def __getattr__(name: str) -> object:
    if name in REMOVED_EXPORTS:  # one line naming the replacement (docs/adapters.md)
        raise removed_export(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
