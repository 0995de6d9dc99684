"""The device-handle interface: what an FSDP implementation asks of a device.

Every stream, event and synchronisation of the reference implementation goes through one
object of this interface (``impl.device`` has the CPU and CUDA handles), and test doubles
implement it on their own (``observe.lagging.LaggingDevice``), so that a double does not depend
on the implementation it tests. It is also all torch FSDP1 uses of its device handle on a CPU
host (torch 2.13.0), so the same doubles drive torch FSDP1. Import-light: typing only.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@runtime_checkable
class DeviceEvent(Protocol):
    """A point in a stream's work (``torch.cuda.Event``'s methods that FSDP uses)."""

    def record(self, stream: Any = None) -> None: ...  # mark the stream's current end
    def query(self) -> bool: ...  # whether the device has reached the event
    def synchronize(self) -> None: ...  # block the CPU until the device reaches it
    def wait(self, stream: Any = None) -> None: ...  # order the stream's later work after it


@runtime_checkable
class DeviceStream(Protocol):
    """An ordered queue of device work (``torch.cuda.Stream``'s methods that FSDP uses)."""

    def wait_stream(self, stream: Any) -> None: ...  # order later work after `stream`'s
    def wait_event(self, event: Any) -> None: ...  # order later work after `event`
    def record_event(self, event: Any = None) -> Any: ...  # record (or make) one, return it
    def synchronize(self) -> None: ...  # block the CPU until the stream's work is done
    def query(self) -> bool: ...  # whether the stream's work is done


@runtime_checkable
class DeviceHandle(Protocol):
    """Streams, events and synchronisation of one compute device: implemented by
    ``impl.device.CPUDeviceHandle`` and ``CUDADeviceHandle`` and by
    ``observe.lagging.LaggingDevice``; ``impl.device.install_device_handle`` and
    ``Adapter.install_device_handle`` accept any object with these members."""

    device_type: str  # the torch device type this handle drives ("cpu", "cuda")
    is_accelerator: bool  # True if pinned host memory is meaningful

    def Event(self, **kwargs: Any) -> Any: ...  # a new, unrecorded DeviceEvent
    def Stream(self, **kwargs: Any) -> Any: ...  # a DeviceStream for side work (all-gathers)
    def stream(self, stream: Any) -> contextlib.AbstractContextManager: ...  # make it current
    def current_stream(self) -> Any: ...
    def synchronize(self) -> None: ...  # block the CPU until all work on the device is done
    def is_available(self) -> bool: ...
    # keep `tensor`'s memory from reuse until `stream`'s current work is done
    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None: ...


@runtime_checkable
class UsesDeviceHandle(Protocol):
    """An object whose streams and events go through a replaceable device handle (an FSDP
    instance of the reference implementation)."""

    def _use_device_handle(self, handle: DeviceHandle) -> None: ...


# the device of the test rank running on this thread (set by the harness around each test)
_rank = threading.local()


def set_rank_device(device: torch.device | None) -> None:
    _rank.device = device


def accelerator_available() -> bool:
    """Whether this code computes on an accelerator (CUDA or another ``torch.accelerator``
    device): in a test rank, whether the rank's device is one (a rank on CPU on a GPU host,
    a thread-mode rank too, says no); elsewhere whether torch can use one. Imports torch."""
    if (device := getattr(_rank, "device", None)) is not None:
        return device.type != "cpu"
    import torch

    return torch.accelerator.is_available()
