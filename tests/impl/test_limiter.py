"""The rate limiter: waits exactly when two frees are outstanding, never when disabled.

A *lagging device* (``fsdp_conformance.observe.lagging``, strict variant) stands in for the
accelerator: its events complete only when the CPU synchronizes on them (or on a later one),
so every free stays outstanding until the limiter waits for it. Residency (all-gather issued
until its free event completed) is reconstructed from the trace.
"""

from __future__ import annotations

import itertools
from unittest import mock

import pytest
import torch
from impl_testlib import FlatSequential, NestedSequential, train

from fsdp_conformance.impl import (
    BackwardPrefetch,
    FullyShardedDataParallel,
    ShardingStrategy,
    install_device_handle,
    trace,
)
from fsdp_conformance.impl.limiter import MAX_INFLIGHT, FreeEventQueue
from fsdp_conformance.observe.lagging import LaggingDevice

# Process mode always: these tests patch classes and observe the process-global trace, and
# the models seed the global RNG (dropout), none of which is rank-local in thread mode.
pytestmark = pytest.mark.fsdp_mode("process")


class Recorder:
    """Checks the limiter rule and measures residency from the trace."""

    def __init__(self, check_rule: bool) -> None:
        self.check_rule = check_rule  # assert the wait rule at every all-gather
        self.live: set = set()  # non-root instances with an allocated unsharded buffer
        self.freed: list = []  # free events of non-root buffers
        self.waits_pending = 0  # rate-limiter waits since the last all-gather
        self.waits = 0
        self.peak = 0
        self.outstanding_at_first_wait = None

    def outstanding(self) -> int:
        return sum(1 for event in self.freed if not event.query())

    def __call__(self, op: str, instance, info: dict) -> None:
        if instance.is_root or info.get("phase") == "summon":
            return
        if op == "rate_limiter_wait":
            if self.waits_pending == 0:
                self.outstanding_at_first_wait = self.outstanding()
            self.waits_pending += 1
            self.waits += 1
        elif op == "all_gather":
            if self.waits_pending:
                before = self.outstanding_at_first_wait
            else:
                before = self.outstanding()
            if self.check_rule:
                # the rule: wait iff two frees are outstanding; afterwards at most one is
                assert (self.waits_pending > 0) == (before >= MAX_INFLIGHT), (
                    f"all-gather with {before} outstanding frees after {self.waits_pending} waits"
                )
            self.waits_pending = 0
            self.live.add(instance)
            self.peak = max(self.peak, len(self.live) + self.outstanding())
        elif op == "free":
            self.live.discard(instance)
            self.freed.append(info["event"])


def run_lagging(dist, check_rule: bool = False, model_class=FlatSequential, **config):
    def wrap(module, **overrides):
        return FullyShardedDataParallel(module, **{**config, **overrides})

    model = FullyShardedDataParallel(model_class(dist.group, wrap), **config)
    install_device_handle(model, LaggingDevice())
    recorder = Recorder(check_rule)
    with (
        trace.observe(recorder),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
    ):
        train(model, steps=2)
    ranges = sum(1 for e in prof.events() if e.name == "FullyShardedDataParallel.rate_limiter")
    return recorder, ranges


NO_PREFETCH = dict(
    sharding_strategy=ShardingStrategy.FULL_SHARD, backward_prefetch=None, forward_prefetch=False
)


def test_free_event_queue_unit():
    live = [0]
    queue = FreeEventQueue(lambda: live[0])
    first, second, third = object(), object(), object()
    queue.enqueue(first)
    assert queue.dequeue_if_needed() is None  # one free outstanding: issue freely
    queue.enqueue(second)
    assert queue.dequeue_if_needed() is first  # two outstanding: wait for the oldest
    assert queue.dequeue_if_needed() is None
    queue.enqueue(third)
    assert queue.dequeue_if_needed(early_prefetch=True) is None  # one extra slot
    assert queue.dequeue_if_needed(counted=False) is None  # the root's buffer is not counted
    live[0] = 1  # a live non-root buffer takes a slot
    assert queue.dequeue_if_needed() is second
    assert queue.dequeue_if_needed() is third
    assert queue.dequeue_if_needed() is None  # empty: nothing to wait for


@pytest.mark.world_size(2)
def test_limiter_waits_exactly_at_two_outstanding_frees(dist):
    recorder, ranges = run_lagging(dist, check_rule=True, limit_all_gathers=True, **NO_PREFETCH)
    assert recorder.waits > 0
    assert ranges == recorder.waits  # every wait is inside the profiler range
    assert recorder.peak <= MAX_INFLIGHT

    disabled, ranges = run_lagging(dist, limit_all_gathers=False, **NO_PREFETCH)
    assert disabled.waits == 0 and ranges == 0
    assert disabled.peak >= 4  # nothing holds the CPU back: every buffer stays resident


@pytest.mark.world_size(2)
def test_limiter_check_catches_a_limiter_without_wait(dist):
    # (patched inside the rank body: a monkeypatch fixture would not be undone in reused ranks)
    no_wait = mock.patch.object(FreeEventQueue, "dequeue_if_needed", lambda self, *a, **k: None)
    with no_wait, pytest.raises(AssertionError, match="outstanding frees"):
        run_lagging(dist, check_rule=True, limit_all_gathers=True, **NO_PREFETCH)


@pytest.mark.world_size(2)
def test_residency_bound_in_every_prefetch_configuration(dist):
    for model_class, backward, forward in itertools.product(
        [FlatSequential, NestedSequential],
        [None, BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST],
        [False, True],
    ):
        early = forward or backward == BackwardPrefetch.BACKWARD_PRE
        recorder, _ = run_lagging(
            dist,
            model_class=model_class,
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            backward_prefetch=backward,
            forward_prefetch=forward,
        )
        bound = MAX_INFLIGHT + (1 if early else 0)
        assert recorder.peak <= bound, (model_class.__name__, backward, forward, recorder.peak)


@pytest.mark.world_size(2)
def test_residency_check_catches_limiter_that_counts_only_frees(dist):
    # FSDP1's rule (count only queued frees) ignores the outer buffer while a nested
    # instance all-gathers: a third buffer becomes resident without any prefetch
    original = FreeEventQueue.dequeue_if_needed

    def frees_only(self, counted=True, early_prefetch=False):
        self._live_buffers = lambda: 0
        return original(self, counted, False)

    with mock.patch.object(FreeEventQueue, "dequeue_if_needed", frees_only):
        recorder, _ = run_lagging(dist, model_class=NestedSequential, **NO_PREFETCH)
    assert recorder.peak > MAX_INFLIGHT
