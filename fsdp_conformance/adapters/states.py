"""The canonical training states, as the adapters see them (defined in
``fsdp_conformance.training_states``; this module keeps the old import path)."""

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
