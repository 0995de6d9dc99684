"""The memory-bound check fails on deliberately broken variants of the reference FSDP.

Each test breaks `fsdp_conformance.impl` inside the rank body (a fixture's monkeypatch would
not reach the rank processes) and asserts the check's failure message: config, iteration,
phase, peak and bound.
"""

from __future__ import annotations

from unittest import mock

import pytest

from fsdp_conformance.adapters import get_adapter
from fsdp_conformance.impl import runtime
from fsdp_conformance.impl.limiter import FreeEventQueue
from fsdp_conformance.suite.memory_bound import BoundCase, check_residency, measure_residency

# Process mode: the patches are process-global (impl's module functions and classes).
pytestmark = [pytest.mark.fsdp_mode("process"), pytest.mark.world_size(2)]


def failure_of(dist, case: BoundCase) -> str:
    """The check's failure message on the (patched) reference FSDP; fails if it passes."""
    tracker = measure_residency(get_adapter("impl"), dist.group, case.wrap_config, case.lag)
    with pytest.raises(AssertionError, match="memory bound exceeded") as failure:
        check_residency(tracker, case, "adapter 'impl' (broken)")
    return str(failure.value)


@pytest.mark.parametrize("lag", ["strict", "drained"])
def test_check_catches_a_limiter_that_never_waits(dist, lag):
    case = BoundCase(lag)
    with mock.patch.object(FreeEventQueue, "dequeue_if_needed", lambda self, *a, **k: None):
        message = failure_of(dist, case)
    assert message.startswith(
        "memory bound exceeded: iteration 1 forward: peak 6 resident non-root unsharded "
        "buffers exceeds the bound 2"
    ), message
    assert f"adapter 'impl' (broken), {case.describe()}" in message
    assert "iteration 1 backward: peak" in message  # every phase is checked, not just the first


def test_check_catches_no_reshard_after_forward(dist):
    original = runtime.post_forward

    def post_forward_keeping_buffers(instance, output):
        with mock.patch.object(runtime, "reshard", lambda instance: None):
            return original(instance, output)

    with mock.patch.object(runtime, "post_forward", post_forward_keeping_buffers):
        message = failure_of(dist, BoundCase("strict"))
    assert message.startswith(
        "memory bound exceeded: iteration 1 forward: peak 6 resident non-root unsharded "
        "buffers exceeds the bound 2"
    ), message


@pytest.mark.parametrize(
    ("backward_prefetch", "forward_prefetch", "phase", "bound"),
    [("BACKWARD_PRE", False, "backward", 3), (None, True, "forward", 3)],
)
def test_check_catches_prefetch_bypassing_the_limiter(
    dist, backward_prefetch, forward_prefetch, phase, bound
):
    original = runtime.unshard

    def unshard_bypassing_limiter_for_prefetch(instance, prefetch=None, early=False):
        if prefetch is None:
            return original(instance, prefetch, early)
        limit, instance.limit_all_gathers = instance.limit_all_gathers, False
        try:
            return original(instance, prefetch, early)
        finally:
            instance.limit_all_gathers = limit

    case = BoundCase("strict", "FULL_SHARD", backward_prefetch, forward_prefetch)
    with mock.patch.object(runtime, "unshard", unshard_bypassing_limiter_for_prefetch):
        message = failure_of(dist, case)
    assert f" {phase}: peak " in message.splitlines()[0], message
    assert f"exceeds the bound {bound} incl. +1 for the early prefetch" in message, message
