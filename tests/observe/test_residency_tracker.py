"""The residency tracker on a scripted sequence of all-gathers and frees (no ranks needed)."""

from __future__ import annotations

import types

import pytest
from torch import nn

from fsdp_conformance.observe.lagging import LaggingDevice
from fsdp_conformance.observe.residency import ResidencyTracker


def make(variant: str = "strict") -> types.SimpleNamespace:
    """A root and three instances (a, b, c) on a lagging device, with a tracker."""
    root, a, b, c = (nn.Linear(1, 1) for _ in range(4))
    device = LaggingDevice(variant)
    tracker = ResidencyTracker(device, [root, a, b, c])
    return types.SimpleNamespace(device=device, tracker=tracker, root=root, a=a, b=b, c=c)


def test_buffer_is_resident_from_all_gather_until_its_free_completes():
    s = make()
    s.tracker.start(1, "forward")
    s.tracker(op="all_gather", instance=s.a, info={})
    assert s.tracker.resident() == (1, 0)
    s.tracker("free", s.a, {})
    assert s.tracker.resident() == (1, 0)  # freed by the CPU, not yet by the device
    free_event = s.device.Event()  # what an implementation records right after the free
    free_event.record()
    s.tracker("all_gather", s.b, {})
    assert s.tracker.resident() == (2, 0)
    free_event.synchronize()  # the limiter's wait completes the earlier marker too
    assert s.tracker.resident() == (1, 0)
    assert s.tracker.resident_by_instance() == {s.tracker.label(s.b): 1}


def test_root_is_reported_separately():
    s = make()
    s.tracker.start(1, "forward")
    s.tracker("all_gather", s.root, {})
    s.tracker("all_gather", s.a, {})
    assert s.tracker.resident() == (1, 1)
    peak = s.tracker.peak(1, "forward")
    assert (peak.resident, peak.root_resident, peak.all_gathers) == (1, 1, 1)
    assert s.tracker.label(s.root) == "root" and s.tracker.label(s.a) == "1:Linear"


def test_peaks_per_phase_count_what_the_phase_issues():
    s = make()
    s.tracker.start(1, "forward")
    for instance in (s.a, s.b, s.c):
        s.tracker("all_gather", instance, {})
        s.tracker("free", instance, {})
    s.tracker.start(1, "backward")  # three frees still draining: not this phase's allocation
    s.device.synchronize()
    s.tracker("all_gather", s.c, {})
    assert s.tracker.peak(1, "forward").resident == 3
    assert s.tracker.peak(1, "forward").at_instance == s.tracker.label(s.c)
    assert s.tracker.peak(1, "backward").resident == 1
    assert s.tracker.peak(2, "forward").resident == 0  # never started
    assert s.tracker.peak_table() == "1 forward 3\n1 backward 1"


@pytest.mark.parametrize(("variant", "left"), [("strict", 1), ("drained", 0)])
def test_drained_device_empties_at_iteration_end_strict_does_not(variant, left):
    s = make(variant)
    s.tracker.start(1, "forward")
    s.tracker("all_gather", s.a, {})
    s.tracker("free", s.a, {})
    s.device.end_iteration()
    assert s.tracker.resident() == (left, 0)


def test_time_series_has_every_event_in_order():
    s = make()
    s.tracker.start(1, "forward")
    s.tracker("all_gather", s.a, {})
    s.tracker("free", s.a, {})
    s.device.synchronize()
    rows = s.tracker.rows()
    assert [(row["op"], row["resident"]) for row in rows] == [
        ("start", 0),
        ("all_gather", 1),
        ("free", 1),
        ("complete", 0),
    ]
    assert [row["index"] for row in rows] == [0, 1, 2, 3]
    assert {row["iteration"] for row in rows} == {1}
    s.tracker.close()
    s.device.Event().record()
    s.device.synchronize()
    assert len(s.tracker.samples) == 4  # closed: no longer listening


def test_same_instance_can_hold_two_buffers():
    # freed but still draining, then gathered again: two buffers of one instance are resident
    s = make()
    s.tracker.start(1, "backward")
    s.tracker("all_gather", s.a, {})
    s.tracker("free", s.a, {})
    s.tracker("all_gather", s.a, {})
    assert s.tracker.resident_by_instance() == {s.tracker.label(s.a): 2}


def test_free_without_all_gather_is_an_error_naming_the_instance():
    s = make()
    with pytest.raises(AssertionError, match="1:Linear freed an unsharded buffer it never"):
        s.tracker("free", s.a, {})


def test_other_ops_are_ignored():
    s = make()
    s.tracker("reduce_scatter", s.a, {})
    s.tracker("prefetch", s.a, {"target": s.b})
    assert s.tracker.samples == [] and s.tracker.resident() == (0, 0)


def test_no_instances_is_an_error():
    with pytest.raises(ValueError, match="adapter.instances"):
        ResidencyTracker(LaggingDevice(), [])
