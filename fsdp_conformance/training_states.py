"""The canonical training states and their legal transitions: the one table that adapters map
into, the state recorder checks against and ``impl.state`` derives its own from. Import-light.

Two levels, as in torch FSDP1: an *instance* state (per FSDP instance, driven by its own hooks)
and a *root* state (FSDP1's coarse ``TrainingState``). The enums subclass ``str``. One training
step of an instance: IDLE -> FORWARD -> IDLE -> BACKWARD_PRE -> BACKWARD_POST -> IDLE;
activation-checkpoint recompute runs a forward inside backward (BACKWARD_PRE -> FORWARD).
"""

from __future__ import annotations

import enum


class InstanceState(str, enum.Enum):
    """The state of one FSDP instance."""

    IDLE = "IDLE"  # outside this instance's forward and backward
    FORWARD = "FORWARD"  # from its pre-forward until its post-forward
    BACKWARD_PRE = "BACKWARD_PRE"  # from its pre-backward until its post-backward
    BACKWARD_POST = "BACKWARD_POST"  # from its post-backward until backward ends
    SUMMON_FULL_PARAMS = "SUMMON_FULL_PARAMS"

    def __str__(self) -> str:
        return self.value


class RootState(str, enum.Enum):
    """The coarse state of an instance object (FSDP1's `TrainingState`); checked on the root."""

    IDLE = "IDLE"
    FORWARD_BACKWARD = "FORWARD_BACKWARD"
    SUMMON_FULL_PARAMS = "SUMMON_FULL_PARAMS"

    def __str__(self) -> str:
        return self.value


# Legal instance transitions (staying in a state is always legal and not listed)
LEGAL_INSTANCE_TRANSITIONS: dict[InstanceState, frozenset[InstanceState]] = {
    InstanceState.IDLE: frozenset(
        {InstanceState.FORWARD, InstanceState.BACKWARD_PRE, InstanceState.SUMMON_FULL_PARAMS}
    ),
    InstanceState.FORWARD: frozenset({InstanceState.IDLE}),
    InstanceState.BACKWARD_PRE: frozenset({InstanceState.BACKWARD_POST, InstanceState.FORWARD}),
    InstanceState.BACKWARD_POST: frozenset({InstanceState.IDLE}),
    InstanceState.SUMMON_FULL_PARAMS: frozenset({InstanceState.IDLE}),
}

# Legal at the end of backward only: BACKWARD_PRE -> IDLE, for an instance none of whose
# parameters got a gradient (so its post-backward never ran; e.g. a parameterless root under
# ``auto_wrap_policy="always"``; FSDP1's end-of-backward callback resets such handles).
END_OF_BACKWARD_TRANSITIONS: dict[InstanceState, frozenset[InstanceState]] = {
    InstanceState.BACKWARD_PRE: frozenset({InstanceState.IDLE})
}

LEGAL_ROOT_TRANSITIONS: dict[RootState, frozenset[RootState]] = {
    RootState.IDLE: frozenset({RootState.FORWARD_BACKWARD, RootState.SUMMON_FULL_PARAMS}),
    RootState.FORWARD_BACKWARD: frozenset({RootState.IDLE}),
    RootState.SUMMON_FULL_PARAMS: frozenset({RootState.IDLE}),
}
