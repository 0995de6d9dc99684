"""Compatibility path (docs/adapters.md): the canonical training states are defined in
``fsdp_conformance.training_states``; import them from there."""

from __future__ import annotations

from fsdp_conformance.training_states import (
    END_OF_BACKWARD_TRANSITIONS,
    LEGAL_INSTANCE_TRANSITIONS,
    LEGAL_ROOT_TRANSITIONS,
    InstanceState,
    RootState,
)

__all__ = [
    "END_OF_BACKWARD_TRANSITIONS",
    "LEGAL_INSTANCE_TRANSITIONS",
    "LEGAL_ROOT_TRANSITIONS",
    "InstanceState",
    "RootState",
]
