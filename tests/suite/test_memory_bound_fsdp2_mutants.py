"""The memory-bound check holds torch FSDP2 to its own bound and fails on broken FSDP2 variants.

Each test breaks `FSDPParamGroup` (torch 2.8.0 to 2.15.0) inside the rank body with
`mock.patch.object`,
which restores it when the block ends, and asserts the check's failure message.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPCommContext, FSDPParamGroup

from fsdp_conformance.adapters import get_adapter
from fsdp_conformance.suite.memory_bound import (
    LAYERS,
    OWN_BOUNDS,
    BoundCase,
    check_residency,
    check_shard_grad_op_forward,
    measure_residency,
)

# Process mode: the patches are process-global (a torch class).
pytestmark = [pytest.mark.fsdp_mode("process"), pytest.mark.world_size(2)]

ADAPTER = "torch-fsdp2"


def stream_wait_target() -> tuple[type, str]:
    """``(owner class, attribute)`` of the wait of both all-gather streams on the previous
    copy-out's event: on ``FSDPParamGroup`` up to torch 2.14, ``FSDPCommContext`` in 2.15."""
    if hasattr(FSDPParamGroup, "_wait_all_gather_streams_on_event"):
        return FSDPParamGroup, "_wait_all_gather_streams_on_event"
    return FSDPCommContext, "wait_all_gather_streams_on_event"


def releases_previous_output_before_copy_out() -> bool:
    """Whether a forward unshard drops the previous all-gather output before its own copy-out
    (torch 2.15) rather than when its wait returns: one output fewer in flight."""
    return hasattr(FSDPCommContext, "release_all_gather_state_for_comm_reuse")


def test_fsdp2_stream_wait_is_found_where_this_torch_keeps_it():
    owner, attribute = stream_wait_target()
    assert callable(getattr(owner, attribute))


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
    # Exact figures derived per detected FSDP2 behaviour (docs/memory_bound.md, the FSDP2 rows).
    # Iteration 1 forward prefetches nothing explicitly: the current all-gather output + 1
    # unsharded, + the previous output while it is kept for overlap -- until the wait returns
    # (torch <= 2.14: 3), or only until the next copy-in (torch 2.15's
    # release_all_gather_state_for_comm_reuse: 2). Iterations 2-3 prefetch the next instance in
    # forward: 3 either way. Backward: 1 output + 1 unsharded.
    first_forward = 2 if releases_previous_output_before_copy_out() else 3
    assert peaks == [first_forward, 3, 3, 2, 2, 2], peaks


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
    # (the wait moved from FSDPParamGroup to FSDPCommContext in torch 2.15: patch where it is)
    owner, attribute = stream_wait_target()
    with mock.patch.object(owner, attribute, lambda *a: None):
        message = failure_of(dist, BoundCase("strict"))
    assert message.startswith("memory bound exceeded: iteration 1 forward: peak "), message


# ---------------------------------------------------------------- SHARD_GRAD_OP's first forward
SHARD_GRAD_OP = BoundCase("strict", "SHARD_GRAD_OP", "BACKWARD_PRE", False)


def shard_grad_op_failure(dist) -> str:
    """check_shard_grad_op_forward's failure message on the (patched) FSDP2; fails if it passes."""
    tracker = measure_residency(
        get_adapter(ADAPTER), dist.group, SHARD_GRAD_OP.wrap_config, SHARD_GRAD_OP.lag
    )
    with pytest.raises(AssertionError, match="SHARD_GRAD_OP forward") as failure:
        check_shard_grad_op_forward(
            tracker, SHARD_GRAD_OP, "adapter 'torch-fsdp2' (broken)", OWN_BOUNDS[ADAPTER]
        )
    return str(failure.value)


def test_shard_grad_op_forward_check_passes_on_fsdp2(dist):
    tracker = measure_residency(
        get_adapter(ADAPTER), dist.group, SHARD_GRAD_OP.wrap_config, SHARD_GRAD_OP.lag
    )
    label = "adapter 'torch-fsdp2'"
    check_shard_grad_op_forward(tracker, SHARD_GRAD_OP, label, OWN_BOUNDS[ADAPTER])
    # the bound, not a release's count: LAYERS kept + 1 or 2 outputs in flight (2.15 vs 2.14)
    assert LAYERS + 1 <= tracker.peak(1, "forward").resident <= LAYERS + 2


def test_shard_grad_op_forward_check_catches_fsdp2_resharding_after_forward(dist):
    # the lower bound: reshard_after_forward=False ignored -- every instance freed after forward
    def reshard_always(self):
        if self.is_unsharded:
            self._to_sharded()

    with mock.patch.object(FSDPParamGroup, "reshard", reshard_always):
        message = shard_grad_op_failure(dist)
    assert message.startswith("SHARD_GRAD_OP forward keeps too few buffers"), message
    assert f"< {LAYERS} resident" in message, message


def test_shard_grad_op_forward_check_catches_fsdp2_keeping_all_gather_outputs(dist):
    # the upper bound: every forward all-gather output kept besides the unsharded parameters
    kept = []
    wait_for_unshard = FSDPParamGroup.wait_for_unshard

    def keeping_wait_for_unshard(self):
        if self._training_state == TrainingState.FORWARD and self._all_gather_result is not None:
            kept.append(self._all_gather_result)
        return wait_for_unshard(self)

    with mock.patch.object(FSDPParamGroup, "wait_for_unshard", keeping_wait_for_unshard):
        message = shard_grad_op_failure(dist)
    kept.clear()
    assert message.startswith("SHARD_GRAD_OP forward holds more than it keeps"), message
    assert f"> {LAYERS + 2} ({LAYERS} kept unsharded + 2 all-gather outputs" in message, message
