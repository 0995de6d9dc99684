"""Training states (DESIGN §4) and their legal transitions."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any


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


_H = HandleTrainingState
# legal handle transitions: state -> states it may move to
HANDLE_TRANSITIONS: dict[HandleTrainingState, frozenset[HandleTrainingState]] = {
    _H.IDLE: frozenset({_H.FORWARD, _H.BACKWARD_PRE, _H.SUMMON_FULL_PARAMS}),
    # FORWARD -> BACKWARD_PRE: post-forward of an activation-checkpoint recompute
    _H.FORWARD: frozenset({_H.IDLE, _H.BACKWARD_PRE}),
    # BACKWARD_PRE -> FORWARD: activation-checkpoint recompute;
    # BACKWARD_PRE -> IDLE: end of backward when no gradient reached the parameters
    _H.BACKWARD_PRE: frozenset({_H.BACKWARD_POST, _H.FORWARD, _H.IDLE}),
    _H.BACKWARD_POST: frozenset({_H.IDLE}),
    _H.SUMMON_FULL_PARAMS: frozenset({_H.IDLE}),
}

_T = TrainingState
# legal instance transitions: state -> states it may move to
INSTANCE_TRANSITIONS: dict[TrainingState, frozenset[TrainingState]] = {
    _T.IDLE: frozenset({_T.FORWARD_BACKWARD, _T.SUMMON_FULL_PARAMS}),
    _T.FORWARD_BACKWARD: frozenset({_T.IDLE}),
    _T.SUMMON_FULL_PARAMS: frozenset({_T.IDLE}),
}


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
