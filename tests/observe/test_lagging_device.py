"""The lagging device's completion semantics (no ranks needed)."""

from __future__ import annotations

import pytest

from fsdp_conformance.device_handle import DeviceHandle
from fsdp_conformance.impl.device import CPUDeviceHandle, CUDADeviceHandle
from fsdp_conformance.observe.lagging import LaggingDevice


def recorded(device: LaggingDevice, count: int) -> list:
    events = [device.Event() for _ in range(count)]
    for event in events:
        event.record()
    return events


@pytest.mark.parametrize("variant", ["strict", "drained"])
def test_events_complete_only_when_the_cpu_synchronizes(variant):
    device = LaggingDevice(variant)
    first, second, third = recorded(device, 3)
    assert not any(event.query() for event in (first, second, third))
    second.synchronize()  # completes it and everything recorded before it
    assert first.query() and second.query() and not third.query()
    first.synchronize()  # already complete: nothing more happens
    assert not third.query() and device.blocking_syncs == 1
    device.synchronize()
    assert third.query() and device.pending == 0


def test_stream_synchronize_completes_everything_recorded():
    device = LaggingDevice()
    first, second = recorded(device, 2)
    device.current_stream().synchronize()
    assert first.query() and second.query()
    later = device.current_stream().record_event()
    assert not later.query()


def test_unrecorded_event_is_complete_and_synchronize_returns():
    device = LaggingDevice()
    (pending,) = recorded(device, 1)
    unrecorded = device.Event()
    assert unrecorded.query()
    unrecorded.synchronize()
    assert not pending.query()  # synchronizing an unrecorded event completes nothing


def test_strict_never_drains_drained_drains_at_iteration_end():
    strict, drained = LaggingDevice("strict"), LaggingDevice("drained")
    (strict_event,) = recorded(strict, 1)
    (drained_event,) = recorded(drained, 1)
    strict.end_iteration()
    drained.end_iteration()
    assert not strict_event.query()
    assert drained_event.query()


def test_finite_lag_completes_after_k_further_events():
    device = LaggingDevice(max_lag=2)
    events = recorded(device, 4)
    assert [event.query() for event in events] == [True, True, False, False]


def test_listeners_hear_every_advance_with_the_reason():
    device = LaggingDevice("drained")
    heard = []

    def listener(dev, reason):
        heard.append((reason, dev.completed))

    device.add_listener(listener)
    first, _ = recorded(device, 2)
    first.synchronize()
    first.synchronize()  # no advance, no call
    device.end_iteration()
    device.remove_listener(listener)
    device.synchronize()
    assert heard == [("event.synchronize", 1), ("end_iteration", 2)]


def test_it_is_a_device_handle_with_the_cpu_interface():
    device = LaggingDevice()
    # the double implements the protocol on its own: it is no kind of impl's handle
    assert isinstance(device, DeviceHandle)
    assert not isinstance(device, CPUDeviceHandle)
    assert not any(
        base.__module__.startswith("fsdp_conformance.impl") for base in type(device).__mro__
    )
    assert (device.device_type, device.is_accelerator) == ("cpu", False)
    stream = device.Stream(priority=-1)
    assert stream is device.current_stream()
    with device.stream(stream):
        stream.wait_stream(stream)
        stream.wait_event(device.Event())
    assert device.is_available()


@pytest.mark.parametrize("kwargs", [{"variant": "lazy"}, {"max_lag": -1}])
def test_bad_arguments_name_the_problem(kwargs):
    with pytest.raises(ValueError, match="LaggingDevice"):
        LaggingDevice(**kwargs)


def test_impl_handles_implement_the_protocol_and_a_partial_one_does_not():
    import torch

    assert isinstance(CPUDeviceHandle(), DeviceHandle)
    assert isinstance(CUDADeviceHandle(torch.device("cuda", 0)), DeviceHandle)  # no GPU touched

    class WithoutRecordStream:
        device_type = "cpu"
        is_accelerator = False

        def Event(self, **kwargs):
            return None

        def Stream(self, **kwargs):
            return None

        def stream(self, stream):
            return None

        def current_stream(self):
            return None

        def synchronize(self):
            return None

        def is_available(self):
            return True

    assert not isinstance(WithoutRecordStream(), DeviceHandle)
