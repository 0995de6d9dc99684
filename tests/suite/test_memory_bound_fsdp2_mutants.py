"""The memory-bound check holds torch FSDP2 to its own bound and fails on broken FSDP2 variants.

Each test breaks `FSDPParamGroup` (torch 2.13.0) inside the rank body with `mock.patch.object`,
which restores it when the block ends, and asserts the check's failure message.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from fsdp_conformance.adapters import get_adapter
from fsdp_conformance.suite.memory_bound import (
    LAYERS,
    OWN_BOUNDS,
    BoundCase,
    check_residency,
    measure_residency,
)

# Process mode: the patches are process-global (a torch class).
pytestmark = [pytest.mark.fsdp_mode("process"), pytest.mark.world_size(2)]

ADAPTER = "torch-fsdp2"


def failure_of(dist, case: BoundCase) -> str:
    """The check's failure message on the (patched) torch FSDP2; fails if it passes."""
    tracker = measure_residency(get_adapter(ADAPTER), dist.group, case.wrap_config, case.lag)
    with pytest.raises(AssertionError, match="memory bound exceeded") as failure:
        check_residency(tracker, case, "adapter 'torch-fsdp2' (broken)", OWN_BOUNDS[ADAPTER])
    return str(failure.value)


def test_fsdp2_is_held_to_its_own_bound(dist):
    case = BoundCase("strict", "FULL_SHARD", "BACKWARD_PRE", True)
    tracker = measure_residency(get_adapter(ADAPTER), dist.group, case.wrap_config, case.lag)
    check_residency(tracker, case, "adapter 'torch-fsdp2'", OWN_BOUNDS[ADAPTER])
    peaks = [tracker.peak(iteration, "forward").resident for iteration in (1, 2, 3)]
    peaks += [tracker.peak(iteration, "backward").resident for iteration in (1, 2, 3)]
    assert peaks == [3, 3, 3, 2, 2, 2], peaks  # docs/memory_bound.md, the FSDP2 rows


@pytest.mark.parametrize("lag", ["strict", "drained"])
def test_check_catches_fsdp2_keeping_every_forward_all_gather_result(dist, lag):
    kept = []  # every forward all-gather result, until the optimizer step
    wait_for_unshard = FSDPParamGroup.wait_for_unshard
    step = torch.optim.SGD.step

    def keeping_wait_for_unshard(self):
        if self._training_state == TrainingState.FORWARD and self._all_gather_result is not None:
            kept.append(self._all_gather_result)
        return wait_for_unshard(self)

    def step_then_drop(self, *args, **kwargs):
        result = step(self, *args, **kwargs)
        kept.clear()
        return result

    with (
        mock.patch.object(FSDPParamGroup, "wait_for_unshard", keeping_wait_for_unshard),
        mock.patch.object(torch.optim.SGD, "step", step_then_drop),
    ):
        message = failure_of(dist, BoundCase(lag))
    assert message.startswith("memory bound exceeded: iteration 1 forward: peak "), message
    assert "exceeds the bound 3 (torch FSDP2's stream-ordered bound" in message, message
    assert "iteration 3 forward: peak" in message  # every step, not just the first
    assert not kept


def test_check_catches_fsdp2_ignoring_reshard_after_forward(dist):
    reshard = FSDPParamGroup.reshard

    def reshard_never_after_forward(self):
        if self._training_state != TrainingState.FORWARD:
            reshard(self)

    with mock.patch.object(FSDPParamGroup, "reshard", reshard_never_after_forward):
        message = failure_of(dist, BoundCase("strict"))
    first = message.splitlines()[0]
    assert first.startswith("memory bound exceeded: iteration 1 forward: peak "), message
    peak = int(first.split("peak ")[1].split()[0])
    assert peak >= LAYERS, message  # every unsharded parameter set stays through forward


def test_check_catches_fsdp2_reusing_all_gather_outputs_without_stream_order(dist):
    # The all-gather streams no longer wait for the copy-out before the output is dropped: a
    # caching allocator may not hand the block to the next all-gather until the device has
    # passed the copy-out, which a strict lagging device never does.
    with mock.patch.object(FSDPParamGroup, "_wait_all_gather_streams_on_event", lambda *a: None):
        message = failure_of(dist, BoundCase("strict"))
    assert message.startswith("memory bound exceeded: iteration 1 forward: peak "), message
