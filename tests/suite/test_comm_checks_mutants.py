"""The prefetch-order, prefetch-happens and collective-count checks fail on broken variants.

Each test breaks `fsdp_conformance.impl` inside the rank body (a fixture's monkeypatch would not
reach the rank processes), runs the check function on the broken reference FSDP and asserts its
failure message.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest

from fsdp_conformance.adapters import get_adapter
from fsdp_conformance.impl import runtime
from fsdp_conformance.impl.exec_order import ExecOrder
from fsdp_conformance.impl.fully_sharded import FullyShardedDataParallel
from fsdp_conformance.suite import comm_checks, prefetch_goldens, training
from fsdp_conformance.suite.test_memory import observed_training

# Process mode: the patches are process-global (impl's module functions and classes).
pytestmark = [pytest.mark.fsdp_mode("process"), pytest.mark.world_size(2)]

PRE_AND_FORWARD = {
    "sharding_strategy": "FULL_SHARD",
    "backward_prefetch": "BACKWARD_PRE",
    "forward_prefetch": True,
}


def trace_of(dist, config, model="nested", **kwargs):
    trace, root = comm_checks.trace_training(get_adapter("impl"), model, dist, config, **kwargs)
    return trace, len(get_adapter("impl").instances(root))


def prefetch_failure(dist, config, model="nested") -> str:
    trace, _ = trace_of(dist, config, model)
    with pytest.raises(AssertionError, match="prefetch does not happen") as failure:
        comm_checks.assert_prefetch_happens(trace, config, "adapter 'impl' (broken)")
    return str(failure.value)


def golden_failure(dist, config, model="nested") -> str:
    trace, _ = trace_of(dist, config, model)
    case = comm_checks.prefetch_case_id(model, config["backward_prefetch"], True)
    with mock.patch.dict(os.environ):
        for name in prefetch_goldens.ACCEPT_ENV_VARS:  # never rewrite the goldens from here
            os.environ.pop(name, None)
        with pytest.raises(AssertionError) as failure:
            prefetch_goldens.check_golden("impl", case, trace.render(ops=None))
    return str(failure.value)


def test_checks_pass_on_the_reference(dist):
    trace, instances = trace_of(dist, PRE_AND_FORWARD)
    comm_checks.assert_prefetch_happens(trace, PRE_AND_FORWARD, "adapter 'impl'")
    comm_checks.assert_counts(trace, "FULL_SHARD", instances, "adapter 'impl'")


def test_prefetch_disabled(dist):
    with mock.patch.object(runtime, "prefetch", lambda instance, direction: None):
        message = prefetch_failure(dist, PRE_AND_FORWARD)
        golden = golden_failure(dist, PRE_AND_FORWARD)
    assert (
        "iteration 2 forward: forward_prefetch did not prefetch: the all-gather of 'module.1' "
        "was issued after '<root>' started its forward compute (expected before)"
    ) in message, message
    assert (
        "iteration 1 backward: BACKWARD_PRE did not prefetch: the all-gather of 'module.1' was "
        "issued after the gradient reduction of 'module.2' (expected before)"
    ) in message, message
    assert "all_gather module.1 IDLE" in golden and "EXPECTTEST_ACCEPT" in golden, golden


def test_prefetch_in_the_wrong_direction(dist):
    def backward_target(self, instance):  # the instance whose backward ran *before*
        if instance not in self.post_forward_order:
            return None
        index = self.post_forward_order.index(instance) + 1
        return self.post_forward_order[index] if index < len(self.post_forward_order) else None

    def forward_target(self, instance):  # the instance whose forward ran *before*
        if self.is_first_iter or instance not in self.pre_forward_order:
            return None
        index = self.pre_forward_order.index(instance) - 1
        return self.pre_forward_order[index] if index >= 0 else None

    with (
        mock.patch.object(ExecOrder, "backward_prefetch_target", backward_target),
        mock.patch.object(ExecOrder, "forward_prefetch_target", forward_target),
    ):
        message = prefetch_failure(dist, PRE_AND_FORWARD)
    assert "iteration 2 forward: forward_prefetch did not prefetch" in message, message
    assert "iteration 1 backward: BACKWARD_PRE did not prefetch" in message, message


def test_backward_pre_prefetching_after_the_free(dist):
    # BACKWARD_PRE behaving like BACKWARD_POST: no prefetch from the pre-backward hook, the
    # post-backward hook prefetches (after the free) as if BACKWARD_POST were configured
    original_prefetch = runtime.prefetch
    original_post_backward = runtime.post_backward_hook

    def prefetch(instance, direction):
        if direction != "backward_pre":
            original_prefetch(instance, direction)

    def post_backward_hook(instance, unsharded):
        configured, instance.backward_prefetch = (
            instance.backward_prefetch,
            runtime.BackwardPrefetch.BACKWARD_POST,
        )
        try:
            return original_post_backward(instance, unsharded)
        finally:
            instance.backward_prefetch = configured

    config = {"sharding_strategy": "FULL_SHARD", "backward_prefetch": "BACKWARD_PRE"}
    with (
        mock.patch.object(runtime, "prefetch", prefetch),
        mock.patch.object(runtime, "post_backward_hook", post_backward_hook),
    ):
        message = prefetch_failure(dist, config)
    assert (
        "BACKWARD_PRE prefetched too late: the all-gather of 'module.1' was issued after "
        "'module.2' freed its parameters"
    ) in message, message


def count_failure(dist, strategy, **kwargs) -> str:
    trace, instances = trace_of(dist, {"sharding_strategy": strategy}, compute=False, **kwargs)
    no_sync = (1,) if "inside_no_sync" in kwargs else ()
    with pytest.raises(AssertionError, match="collective counts differ") as failure:
        comm_checks.assert_counts(trace, strategy, instances, "adapter 'impl' (broken)", no_sync)
    return str(failure.value)


def test_counts_catch_an_extra_all_gather(dist):
    original = runtime.pre_backward_hook

    def pre_backward_gathering_twice(instance, grad):
        first = not instance.ran_pre_backward
        original(instance, grad)
        if first and not instance.is_root:  # gather again: one extra all-gather each
            runtime.reshard(instance)
            runtime.unshard(instance)
            runtime.wait_unshard(instance)

    with mock.patch.object(runtime, "pre_backward_hook", pre_backward_gathering_twice):
        message = count_failure(dist, "FULL_SHARD")
    assert "iteration 1 backward: 6 all-gathers, expected at most 4: no instance gathers more " in (
        message
    ), message


def test_no_reshard_after_forward_is_within_the_counts_and_caught_by_the_memory_check(dist):
    original = runtime.post_forward

    def post_forward_keeping_buffers(instance, output):
        with mock.patch.object(runtime, "reshard", lambda instance: None):
            return original(instance, output)

    # the counts are bounds (no backward all-gather is within them); that FULL_SHARD reshards
    # after forward is memory.reshard_after_forward's promise, which sees the kept buffers
    adapter = get_adapter("impl")
    with mock.patch.object(runtime, "post_forward", post_forward_keeping_buffers):
        trace, instances = trace_of(dist, {"sharding_strategy": "FULL_SHARD"}, compute=False)
        comm_checks.assert_counts(trace, "FULL_SHARD", instances, "adapter 'impl' (broken)")
        config = {"sharding_strategy": "FULL_SHARD"}
        root, zoo_model = training.build(adapter, "nested", dist, config)
        probe, _ = observed_training(adapter, root, zoo_model, dist)
    kept = {label: names for label, names in probe.alive.items() if label != probe.root_label}
    assert all(kept.get(label) for label in ("module.1", "module.1.0", "module.2")), kept


def test_counts_catch_a_reduction_inside_no_sync(dist):
    with mock.patch.object(FullyShardedDataParallel, "no_sync", lambda self: mock.MagicMock()):
        message = count_failure(dist, "FULL_SHARD", inside_no_sync=lambda i: i == 1)
    assert "iteration 1 backward inside no_sync: 4 gradient reductions, expected 0" in message, (
        message
    )
