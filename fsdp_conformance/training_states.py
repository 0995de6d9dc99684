"""The canonical training states and their legal transitions: the one table.

Every adapter maps its implementation's states into these (``fsdp_conformance.adapters``), the
training-state recorder checks observed states against them (``fsdp_conformance.observe``), and
the reference implementation derives its own table from them (``fsdp_conformance.impl.state``,
which writes down where it differs and why). Import-light: no torch, no other module of the
package, so that every layer can import it.

Two levels, as in torch FSDP1: an *instance* state (per FSDP instance, driven by its own hooks)
and a *root* state (the coarse state of the instance object; FSDP1's ``TrainingState``).
The enums subclass ``str``, so ``state == "IDLE"`` works and traces render plainly.

The life of an instance in one training step: IDLE -> FORWARD (pre-forward unshards) -> IDLE
(post-forward reshards) -> BACKWARD_PRE (pre-backward unshards) -> BACKWARD_POST (its gradient
is ready: reshard, reduce) -> IDLE (end of backward). Activation-checkpoint recompute runs a
forward inside backward, so BACKWARD_PRE -> FORWARD is legal too. Inside
``summon_full_params`` an instance is in SUMMON_FULL_PARAMS.
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


# Legal instance transitions. Activation-checkpoint recompute may enter FORWARD from
# BACKWARD_PRE. Staying in a state is always legal and not listed.
LEGAL_INSTANCE_TRANSITIONS: dict[InstanceState, frozenset[InstanceState]] = {
    InstanceState.IDLE: frozenset(
        {InstanceState.FORWARD, InstanceState.BACKWARD_PRE, InstanceState.SUMMON_FULL_PARAMS}
    ),
    InstanceState.FORWARD: frozenset({InstanceState.IDLE}),
    InstanceState.BACKWARD_PRE: frozenset({InstanceState.BACKWARD_POST, InstanceState.FORWARD}),
    InstanceState.BACKWARD_POST: frozenset({InstanceState.IDLE}),
    InstanceState.SUMMON_FULL_PARAMS: frozenset({InstanceState.IDLE}),
}

# Legal at the end of backward only: BACKWARD_PRE -> IDLE, for an instance whose post-backward
# never runs because none of its parameters received a gradient in this backward (an instance
# without parameters of its own, e.g. the root under ``auto_wrap_policy="always"``; torch
# FSDP1's end-of-backward callback resets such handles explicitly).
END_OF_BACKWARD_TRANSITIONS: dict[InstanceState, frozenset[InstanceState]] = {
    InstanceState.BACKWARD_PRE: frozenset({InstanceState.IDLE})
}

# Legal root transitions.
LEGAL_ROOT_TRANSITIONS: dict[RootState, frozenset[RootState]] = {
    RootState.IDLE: frozenset({RootState.FORWARD_BACKWARD, RootState.SUMMON_FULL_PARAMS}),
    RootState.FORWARD_BACKWARD: frozenset({RootState.IDLE}),
    RootState.SUMMON_FULL_PARAMS: frozenset({RootState.IDLE}),
}
