"""check_shard_grad_op_forward: two bounds, not one release's count, without ranks."""

from __future__ import annotations

import types

import pytest

from fsdp_conformance.suite import BaseMemoryBoundTests
from fsdp_conformance.suite.memory_bound import LAYERS, BoundCase, check_shard_grad_op_forward
from fsdp_conformance.suite.stream_bound import FSDP2_BOUND

CASE = BoundCase("strict", "SHARD_GRAD_OP", "BACKWARD_PRE", False)


def tracker_with_first_forward(resident: int):
    peak = types.SimpleNamespace(resident=resident)
    return types.SimpleNamespace(peak=lambda iteration, phase: peak)


@pytest.mark.parametrize(
    ("resident", "own_bound"),
    [(LAYERS, None), (LAYERS, FSDP2_BOUND), (LAYERS + 1, FSDP2_BOUND), (LAYERS + 2, FSDP2_BOUND)],
)
def test_within_both_bounds_passes(resident, own_bound):
    check_shard_grad_op_forward(tracker_with_first_forward(resident), CASE, "x", own_bound)


@pytest.mark.parametrize("own_bound", [None, FSDP2_BOUND])
def test_below_the_kept_instances_fails(own_bound):
    with pytest.raises(AssertionError, match="SHARD_GRAD_OP forward keeps too few buffers") as e:
        check_shard_grad_op_forward(tracker_with_first_forward(LAYERS - 1), CASE, "x", own_bound)
    assert f"peak {LAYERS - 1} < {LAYERS} resident" in str(e.value)


@pytest.mark.parametrize(("own_bound", "most"), [(None, LAYERS), (FSDP2_BOUND, LAYERS + 2)])
def test_above_the_kept_instances_and_outputs_in_flight_fails(own_bound, most):
    with pytest.raises(AssertionError, match="SHARD_GRAD_OP forward holds more than it keeps"):
        check_shard_grad_op_forward(tracker_with_first_forward(most + 1), CASE, "x", own_bound)


def test_the_removed_class_attribute_is_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"declare them on the adapter instead"):

        class Old(BaseMemoryBoundTests):  # noqa: F841
            known_deviations = {"impl": lambda case: "why"}


def test_an_own_bound_needs_only_its_protocol():
    # an implementation's own bound (OWN_BOUNDS) is duck-typed: bound, explain and
    # shard_grad_op_forward -- no StreamOrderedBound fields
    class OwnBound:
        def bound(self, phase):
            return 2

        def explain(self, phase):
            return "own"

        def shard_grad_op_forward(self, layers):
            return layers + 1

    check_shard_grad_op_forward(tracker_with_first_forward(LAYERS + 1), CASE, "x", OwnBound())
    with pytest.raises(AssertionError, match=rf"> {LAYERS + 1} \({LAYERS} kept unsharded \+ 1"):
        check_shard_grad_op_forward(tracker_with_first_forward(LAYERS + 2), CASE, "x", OwnBound())
