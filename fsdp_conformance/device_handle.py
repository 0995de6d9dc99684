"""The device-handle interface: what an FSDP implementation asks of a device.

Every stream, event and synchronisation of the reference implementation goes through one
object of this interface (``fsdp_conformance.impl.device`` has the CPU and CUDA handles), and
test doubles implement it on their own (``fsdp_conformance.observe.lagging.LaggingDevice``, a
device on which the CPU always runs ahead), so that a double does not depend on the
implementation it is used to test. It is also all torch FSDP1 uses of its device handle on a CPU
host (torch 2.13.0), so the same doubles drive torch FSDP1.

Import-light: typing only (no torch at import time, no other module of the package), so that
impl, observe and adapters can all import it. ``accelerator_available`` is the one test for an
accelerator every layer uses.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@runtime_checkable
class DeviceEvent(Protocol):
    """A point in a stream's work (``torch.cuda.Event``'s methods that FSDP uses)."""

    def record(self, stream: Any = None) -> None:
        """Mark the current end of ``stream``'s work (default: the current stream)."""

    def query(self) -> bool:
        """Whether the device has reached the event."""

    def synchronize(self) -> None:
        """Block the CPU until the device has reached the event."""

    def wait(self, stream: Any = None) -> None:
        """Make ``stream``'s later work wait for the event (ordering only)."""


@runtime_checkable
class DeviceStream(Protocol):
    """An ordered queue of device work (``torch.cuda.Stream``'s methods that FSDP uses)."""

    def wait_stream(self, stream: Any) -> None:
        """Order this stream's later work after ``stream``'s current work."""

    def wait_event(self, event: Any) -> None:
        """Order this stream's later work after ``event``."""

    def record_event(self, event: Any = None) -> Any:
        """Record ``event`` (or a new one) at the stream's current end and return it."""

    def synchronize(self) -> None:
        """Block the CPU until the stream's work is done."""

    def query(self) -> bool:
        """Whether the stream's work is done."""


@runtime_checkable
class DeviceHandle(Protocol):
    """Streams, events and synchronisation of one compute device.

    Implemented by ``impl.device.CPUDeviceHandle`` and ``CUDADeviceHandle`` and by
    ``observe.lagging.LaggingDevice``; ``impl.device.install_device_handle`` and
    ``Adapter.install_device_handle`` accept any object with these members.
    """

    # the torch device type this handle drives ("cpu", "cuda")
    device_type: str
    # True if pinned host memory is meaningful (there is an accelerator)
    is_accelerator: bool

    def Event(self, **kwargs: Any) -> Any:
        """A new, unrecorded event (a ``DeviceEvent``)."""

    def Stream(self, **kwargs: Any) -> Any:
        """A stream (a ``DeviceStream``) for side work such as all-gathers."""

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """Context manager making ``stream`` the current stream."""

    def current_stream(self) -> Any:
        """The current stream."""

    def synchronize(self) -> None:
        """Block the CPU until all work on the device is done."""

    def is_available(self) -> bool:
        """Whether the device can be used."""

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Keep ``tensor``'s memory from reuse until ``stream``'s current work is done."""


@runtime_checkable
class UsesDeviceHandle(Protocol):
    """An object whose streams and events go through a replaceable device handle (an FSDP
    instance of the reference implementation)."""

    def _use_device_handle(self, handle: DeviceHandle) -> None:
        """Route this object's streams, events and synchronisation through ``handle``."""


def accelerator_available() -> bool:
    """Whether this host has an accelerator torch can use (CUDA or another ``torch.accelerator``
    device; pinned host memory is worth it only then). Imports torch when called."""
    import torch

    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return accelerator.is_available()
    return torch.cuda.is_available()
