"""One canonical transition table; impl's table is it plus a written-down difference."""

from __future__ import annotations

import types

import pytest

from fsdp_conformance import adapters, training_states
from fsdp_conformance.impl import state as impl_state
from fsdp_conformance.observe import states as observe_states
from fsdp_conformance.training_states import InstanceState


def by_name(table: dict) -> dict[str, set[str]]:
    return {source.name: {target.name for target in targets} for source, targets in table.items()}


def undocumented_moves(table: dict, canonical: dict, documented: dict) -> set[tuple[str, str]]:
    """Moves of ``table`` that are neither canonical nor in ``documented`` (all by name)."""
    allowed = by_name(canonical)
    for source, targets in by_name(documented).items():
        allowed[source] = allowed.get(source, set()) | targets
    return {
        (source, target)
        for source, targets in by_name(table).items()
        for target in targets
        if target not in allowed.get(source, set())
    }


def test_the_other_modules_reuse_the_canonical_table():
    for name in (
        "InstanceState",
        "RootState",
        "LEGAL_INSTANCE_TRANSITIONS",
        "LEGAL_ROOT_TRANSITIONS",
    ):
        assert getattr(adapters, name) is getattr(training_states, name), name
    assert observe_states.LEGAL_INSTANCE_TRANSITIONS is training_states.LEGAL_INSTANCE_TRANSITIONS
    assert observe_states.LEGAL_ROOT_TRANSITIONS is training_states.LEGAL_ROOT_TRANSITIONS


def test_impl_differs_only_where_it_says():
    canonical = training_states.LEGAL_INSTANCE_TRANSITIONS
    handle = impl_state.HANDLE_TRANSITIONS
    assert set(by_name(handle)) == set(by_name(canonical))
    assert not undocumented_moves(handle, canonical, impl_state.IMPL_EXTRA_TRANSITIONS)
    extra = {
        (source, target)
        for source, targets in by_name(handle).items()
        for target in targets - by_name(canonical)[source]
    }
    assert extra == {("FORWARD", "BACKWARD_PRE"), ("BACKWARD_PRE", "IDLE")}
    assert by_name(impl_state.TRAINING_TRANSITIONS) == by_name(
        training_states.LEGAL_ROOT_TRANSITIONS
    )


def test_an_undocumented_difference_is_found():
    broken = dict(impl_state.HANDLE_TRANSITIONS)
    idle = impl_state.HandleTrainingState.IDLE
    broken[idle] = broken[idle] | {impl_state.HandleTrainingState.BACKWARD_POST}
    moves = undocumented_moves(
        broken, training_states.LEGAL_INSTANCE_TRANSITIONS, impl_state.IMPL_EXTRA_TRANSITIONS
    )
    assert moves == {("IDLE", "BACKWARD_POST")}


def test_impl_refuses_a_move_neither_table_allows():
    instance = types.SimpleNamespace(
        handle_training_state=impl_state.HandleTrainingState.IDLE, name=lambda: "<root>"
    )
    with pytest.raises(RuntimeError, match="illegal handle_training_state transition IDLE -> "):
        impl_state.transition(instance, impl_state.HandleTrainingState.BACKWARD_POST, "test")
    impl_state.transition(instance, impl_state.HandleTrainingState.FORWARD, "test")
    impl_state.transition(instance, impl_state.HandleTrainingState.BACKWARD_PRE, "test")
    assert instance.handle_training_state is impl_state.HandleTrainingState.BACKWARD_PRE
    assert (
        InstanceState.BACKWARD_PRE
        not in training_states.LEGAL_INSTANCE_TRANSITIONS[InstanceState.FORWARD]
    )
