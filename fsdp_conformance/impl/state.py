"""The reference implementation's training states and their legal transitions.

The handle states are the canonical instance states of ``fsdp_conformance.training_states``
(same names); ``HANDLE_TRANSITIONS`` is the canonical table plus ``IMPL_EXTRA_TRANSITIONS``,
the two moves this implementation makes that the canonical table does not list (each with its
reason below). The instance-level ``TrainingState`` is the canonical root state.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any

from fsdp_conformance import training_states
from fsdp_conformance.training_states import InstanceState


class TrainingState(enum.Enum):
    """Instance-level state (torch FSDP1's ``TrainingState``)."""

    # Not inside forward/backward or summon_full_params
    IDLE = enum.auto()
    # From the instance's pre-forward until the end of the root's backward
    FORWARD_BACKWARD = enum.auto()
    # Inside summon_full_params
    SUMMON_FULL_PARAMS = enum.auto()


class HandleTrainingState(enum.Enum):
    """Per-flat-parameter state: where in the step the instance's parameters are."""

    # Between phases (after post-forward, after backward, after optimizer.step())
    IDLE = enum.auto()
    # From pre-forward (unshard) to post-forward (reshard)
    FORWARD = enum.auto()
    # Transition to pre-backward when unsharding in backward
    BACKWARD_PRE = enum.auto()
    # Transition to post-backward when the flat parameter's gradient is ready
    BACKWARD_POST = enum.auto()
    # Inside summon_full_params
    SUMMON_FULL_PARAMS = enum.auto()


_I = InstanceState
# Where this implementation's handle table differs from the canonical instance table (in names
# of the canonical states; only additions):
IMPL_EXTRA_TRANSITIONS: dict[InstanceState, frozenset[InstanceState]] = {
    # The post-forward of an activation-checkpoint recompute runs inside backward: it reshards
    # and puts the handle back to BACKWARD_PRE (not IDLE), so that the handle's coming
    # pre-backward and post-backward find it where backward left it (torch FSDP1 does the same).
    # The canonical table leaves this move out (FORWARD ends in IDLE there); the suite's
    # training-state checks (suite/states.py) run no activation checkpointing, so they never
    # sample it.
    _I.FORWARD: frozenset({_I.BACKWARD_PRE}),
    # End of backward for a handle whose parameters received no gradient (its post-backward
    # never ran): canonical only at the end of backward (END_OF_BACKWARD_TRANSITIONS);
    # ``transition`` does not know where it is called from, so the move is always allowed and
    # the end-of-backward callback is the only caller that makes it.
    **training_states.END_OF_BACKWARD_TRANSITIONS,
}


def _derived_table(
    state_type: type[enum.Enum],
    canonical: dict[Any, frozenset[Any]],
    extra: dict[Any, frozenset[Any]],
) -> dict[Any, frozenset[Any]]:
    """``canonical`` plus ``extra``, in the states of ``state_type`` (matched by name)."""
    table = {}
    for source, targets in canonical.items():
        names = {target.name for target in targets | extra.get(source, frozenset())}
        table[state_type[source.name]] = frozenset(state_type[name] for name in names)
    return table


# legal handle transitions: state -> states it may move to
HANDLE_TRANSITIONS: dict[HandleTrainingState, frozenset[HandleTrainingState]] = _derived_table(
    HandleTrainingState, training_states.LEGAL_INSTANCE_TRANSITIONS, IMPL_EXTRA_TRANSITIONS
)

# legal instance transitions: state -> states it may move to (the canonical root table)
INSTANCE_TRANSITIONS: dict[TrainingState, frozenset[TrainingState]] = _derived_table(
    TrainingState, training_states.LEGAL_ROOT_TRANSITIONS, {}
)


def transition(instance: Any, new_state: TrainingState | HandleTrainingState, where: str) -> None:
    """Move ``instance`` to ``new_state``, raising if the move is illegal.

    Args:
        instance: the FSDP instance.
        new_state: a ``TrainingState`` or ``HandleTrainingState``.
        where: the hook or method making the move (for the error message).
    """
    if isinstance(new_state, HandleTrainingState):
        attribute, table = "handle_training_state", HANDLE_TRANSITIONS
    else:
        attribute, table = "training_state", INSTANCE_TRANSITIONS
    current = getattr(instance, attribute)
    if current == new_state:
        return
    if new_state not in table[current]:
        allowed = sorted(s.name for s in table[current])
        raise RuntimeError(
            f"{type(instance).__name__} at {instance._fsdp_name()}: illegal {attribute} "
            f"transition {current.name} -> {new_state.name} in {where}; from {current.name} "
            f"only {allowed} are allowed"
        )
    setattr(instance, attribute, new_state)


def assert_state(instance: Any, states: Any) -> None:
    """Raise AssertionError unless ``instance`` is in one of ``states``.

    Args:
        instance: the FSDP instance.
        states: a ``TrainingState``/``HandleTrainingState`` or an iterable of them; each is
            compared with the attribute of its own type.
    """
    wanted = [states] if isinstance(states, enum.Enum) else list(states)
    for state in wanted:
        attribute = (
            "handle_training_state" if isinstance(state, HandleTrainingState) else "training_state"
        )
        if getattr(instance, attribute) == state:
            return
    seen = f"training_state={instance.training_state.name}, " + (
        f"handle_training_state={instance.handle_training_state.name}"
    )
    raise AssertionError(
        f"{type(instance).__name__} at {instance._fsdp_name()} expected to be in "
        f"{_names(wanted)} but is in {seen}"
    )


def _names(states: Iterable[enum.Enum]) -> list[str]:
    return [f"{type(s).__name__}.{s.name}" for s in states]
