"""The members of the older, wider `Adapter` (negotiation, deviations, declarations, loop
hooks on the class), answered for code that still calls them on an adapter."""

from __future__ import annotations

import functools
from typing import Any

from . import base, deviations, features, loop

# old method -> the module function taking the adapter first
_FUNCTIONS = {
    "supports": features.supports,
    "check": features.require,
    "require": features.skip_unless,
    "unsupported_reason": features.why_unsupported,
    "features_for": features.wrap_features,
    "_check_values": features.require_values,
    "support_problem": features.support_problem,
    "find_deviation": deviations.find_deviation,
    "deviation": deviations.deviation_reason,
    "deviation_text": deviations.deviation_text,
    "delegation_chain": deviations.delegation_chain,
    "running_versions": deviations.running_versions,
    "group_size": loop.group_size,
    "assert_state": loop.assert_state,
    "delay_before_reduction": loop.delay_before_reduction,
    "delay_before_free": loop.delay_before_free,
    "_optimizer_class": loop.optimizer_class,
}
_DECLARED = ("known_deviations", "wrapper_segments", "grad_reduction", "instance_states")


def old_member(adapter: Any, name: str) -> Any:
    """What ``adapter.<name>`` meant in the older protocol; AttributeError for other names."""
    if name == "capabilities":
        return features.capabilities(adapter)
    if name in _FUNCTIONS:
        return functools.partial(_FUNCTIONS[name], adapter)
    if name in loop.HOOKS:
        return loop._hook(adapter, name)
    if name in _DECLARED:
        return getattr(features.declared(adapter), name)
    if name == "delegates_to":
        return adapter.declarations.delegates_to
    if name == "unsupported":
        return lambda: dict(features.declared(adapter).unsupported)
    if name == "unsupported_values":
        return lambda: dict(features.declared(adapter).unsupported_values)
    if name == "wrapping_root":
        return None
    raise AttributeError(f"{type(adapter).__name__!r} object has no attribute {name!r}")


base.OLD_MEMBERS = old_member
