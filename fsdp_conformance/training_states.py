"""Canonical training states (DESIGN §4), the vocabulary every adapter maps into.

Two levels, as in torch FSDP1: an *instance* state (per FSDP instance, driven by its own hooks)
and a *root* state (the coarse state of the instance object; FSDP1's `TrainingState`).
The enums subclass `str`, so `state == "IDLE"` works and traces render plainly.
"""
from __future__ import annotations

import enum


class InstanceState(str, enum.Enum):
    """The state of one FSDP instance."""

    # Not inside forward or backward of this instance (also between forward and backward)
    IDLE = "IDLE"
    # From this instance's pre-forward until its post-forward (also AC recompute in backward)
    FORWARD = "FORWARD"
    # From this instance's pre-backward (unshard for backward) until its post-backward
    BACKWARD_PRE = "BACKWARD_PRE"
    # From this instance's post-backward (reshard, reduce gradients) until backward ends
    BACKWARD_POST = "BACKWARD_POST"
    # Inside summon_full_params
    SUMMON_FULL_PARAMS = "SUMMON_FULL_PARAMS"

    def __str__(self) -> str:
        return self.value


class RootState(str, enum.Enum):
    """The coarse state of an instance object (FSDP1's `TrainingState`); checked on the root."""

    # Outside forward/backward
    IDLE = "IDLE"
    # Inside forward or backward
    FORWARD_BACKWARD = "FORWARD_BACKWARD"
    # Inside summon_full_params
    SUMMON_FULL_PARAMS = "SUMMON_FULL_PARAMS"

    def __str__(self) -> str:
        return self.value


# Legal instance transitions (DESIGN §4). Activation-checkpoint recompute may enter FORWARD
# from BACKWARD_PRE. Staying in a state is always legal and not listed.
LEGAL_INSTANCE_TRANSITIONS: dict[InstanceState, frozenset[InstanceState]] = {
    InstanceState.IDLE: frozenset(
        {InstanceState.FORWARD, InstanceState.BACKWARD_PRE, InstanceState.SUMMON_FULL_PARAMS}
    ),
    InstanceState.FORWARD: frozenset({InstanceState.IDLE}),
    InstanceState.BACKWARD_PRE: frozenset({InstanceState.BACKWARD_POST, InstanceState.FORWARD}),
    InstanceState.BACKWARD_POST: frozenset({InstanceState.IDLE}),
    InstanceState.SUMMON_FULL_PARAMS: frozenset({InstanceState.IDLE}),
}

# Legal root transitions (DESIGN §4).
LEGAL_ROOT_TRANSITIONS: dict[RootState, frozenset[RootState]] = {
    RootState.IDLE: frozenset({RootState.FORWARD_BACKWARD, RootState.SUMMON_FULL_PARAMS}),
    RootState.FORWARD_BACKWARD: frozenset({RootState.IDLE}),
    RootState.SUMMON_FULL_PARAMS: frozenset({RootState.IDLE}),
}
