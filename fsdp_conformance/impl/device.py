"""The device handle: every stream, event and synchronisation goes through one object.

This is the only module that calls ``torch.cuda``. Both handles implement the
``fsdp_conformance.device_handle.DeviceHandle`` protocol. ``CPUDeviceHandle`` has events that
are complete at once and streams that are no-ops (on CPU the asynchrony lives in the
gloo work handles). Tests substitute their own handle (e.g. a lagging device whose
events complete only when synchronised) with ``install_device_handle``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from fsdp_conformance.device_handle import DeviceHandle, UsesDeviceHandle


class CPUEvent:
    """An event that is complete as soon as it is recorded."""

    def record(self, stream: Any = None) -> None:
        """Nothing to record: the CPU is the device."""

    def synchronize(self) -> None:
        """Already complete."""

    def query(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for."""


class CPUStream:
    """A stream on which all work is already complete."""

    def wait_stream(self, stream: Any) -> None:
        """Ordering is program order on the CPU."""

    def wait_event(self, event: Any) -> None:
        """Ordering is program order on the CPU."""

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else CPUEvent()

    def synchronize(self) -> None:
        """Already complete."""

    def query(self) -> bool:
        return True


class CPUDeviceHandle:
    """Device handle for CPU compute (a ``DeviceHandle``)."""

    # the torch device type this handle drives
    device_type = "cpu"
    # True if pinned host memory is meaningful (there is an accelerator)
    is_accelerator = False

    def __init__(self) -> None:
        # the one stream everything runs on
        self._stream = CPUStream()

    def Event(self, **kwargs: Any) -> Any:
        """Create an event (complete at once)."""
        return CPUEvent()

    def Stream(self, **kwargs: Any) -> Any:
        """Create a stream (all streams are the same on CPU)."""
        return self._stream

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """Context manager making ``stream`` current (no-op on CPU)."""
        return contextlib.nullcontext()

    def current_stream(self) -> Any:
        return self._stream

    def synchronize(self) -> None:
        """Wait for all device work (none on CPU)."""

    def is_available(self) -> bool:
        return True

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Keep ``tensor``'s memory from reuse until ``stream``'s current work is done."""


class CUDADeviceHandle(CPUDeviceHandle):
    """Device handle for one CUDA device (``torch.cuda`` streams and events; a
    ``DeviceHandle``)."""

    device_type = "cuda"
    is_accelerator = True

    def __init__(self, device: torch.device) -> None:
        # the CUDA device the streams belong to
        self.device = device

    def Event(self, **kwargs: Any) -> Any:
        return torch.cuda.Event(**kwargs)

    def Stream(self, **kwargs: Any) -> Any:
        return torch.cuda.Stream(device=self.device, **kwargs)

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


def device_handle_for(device: torch.device) -> DeviceHandle:
    """The default handle for a compute device."""
    if device.type == "cuda":
        return CUDADeviceHandle(device)
    return CPUDeviceHandle()


def install_device_handle(module: nn.Module, handle: DeviceHandle) -> None:
    """Make every FSDP instance under ``module`` use ``handle`` for streams and events.

    Call after wrapping and before the first forward (or between iterations). The instances
    are the modules of ``module``'s tree (pre-order) that take a device handle
    (``UsesDeviceHandle``: the reference implementation's FSDP instances).

    Args:
        module: a module containing (or being) FSDP instances.
        handle: an object with the ``DeviceHandle`` interface.
    """
    instances = [m for m in module.modules() if isinstance(m, UsesDeviceHandle)]
    if not instances:
        raise ValueError(f"install_device_handle: no FSDP instance under {type(module).__name__}")
    for instance in instances:
        instance._use_device_handle(handle)
