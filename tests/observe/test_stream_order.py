"""The residency tracker's stream-ordered reuse rule, on a lagging device (no ranks)."""

from __future__ import annotations

from torch import nn

from fsdp_conformance.observe import LaggingDevice, ResidencyTracker
from fsdp_conformance.observe.stream_order import OrderedStream, reusable_at_free


def tracker_with(device):
    root, layer = nn.Linear(2, 2), nn.Linear(2, 2)
    tracker = ResidencyTracker(device, [root, layer])
    tracker.start(1, "forward")
    return tracker, layer


def test_block_used_only_by_its_own_stream_is_reusable_at_free():
    device = LaggingDevice("strict")
    tracker, layer = tracker_with(device)
    stream = device.current_stream()
    tracker("alloc", layer, {"buffer": "unsharded", "stream": stream})
    assert tracker.resident() == (1, 0)
    tracker("free", layer, {"buffer": "unsharded", "stream": stream, "used_after": None})
    assert tracker.resident() == (0, 0)


def test_block_used_by_another_stream_waits_for_the_device_unless_ordered():
    device = LaggingDevice("strict")
    tracker, layer = tracker_with(device)
    copy_in = OrderedStream(device, "copy_in")
    # used by the current stream after event 0; copy_in never waited: not reusable at free
    tracker("all_gather", layer, {"buffer": "out", "stream": copy_in})
    used_after = device.recorded
    tracker("free", layer, {"buffer": "out", "stream": copy_in, "used_after": used_after})
    assert tracker.resident() == (1, 0)
    device.synchronize()  # the device passes the free: reusable
    assert tracker.resident() == (0, 0)
    # the same, with copy_in made to wait for an event recorded after the use: at once
    tracker("all_gather", layer, {"buffer": "out", "stream": copy_in})
    used_after = device.recorded
    event = device.Event()
    event.record()
    copy_in.wait_event(event)
    assert reusable_at_free(copy_in, used_after)
    tracker("free", layer, {"buffer": "out", "stream": copy_in, "used_after": used_after})
    assert tracker.resident() == (0, 0)
    assert device.completed < device.recorded  # nothing had to complete


def test_free_without_stream_is_the_record_stream_case():
    device = LaggingDevice("strict")
    tracker, layer = tracker_with(device)
    tracker("all_gather", layer, {})
    tracker("free", layer, {})
    assert tracker.resident() == (1, 0)  # until the marker recorded at the free completes
    device.synchronize()
    assert tracker.resident() == (0, 0)
