"""The device handles (``fsdp_conformance.device_handle.DeviceHandle``): every stream, event and
synchronisation goes through one; the only module calling ``torch.cuda``. On CPU events are
complete at once and streams are no-ops (the asynchrony lives in gloo's work handles)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from fsdp_conformance.device_handle import DeviceHandle, UsesDeviceHandle


class CPUWork:
    """A CPU event or stream: complete at once, ordered by program order."""

    def _nothing(self, *stream_or_event: Any) -> None:
        """Nothing to record or wait for: CPU work is done when the call returns."""

    # an event's record / wait / synchronize, a stream's wait_stream / wait_event
    record = wait = synchronize = wait_stream = wait_event = _nothing

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else CPUWork()

    def query(self) -> bool:
        return True


class CPUDeviceHandle:
    """Device handle for CPU compute."""

    device_type = "cpu"
    # whether pinned host memory is meaningful (there is an accelerator)
    is_accelerator = False

    def __init__(self) -> None:
        self._stream = CPUWork()

    def Event(self, **kwargs: Any) -> Any:
        return CPUWork()

    def Stream(self, **kwargs: Any) -> Any:
        return self._stream

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def current_stream(self) -> Any:
        return self._stream

    def synchronize(self) -> None:
        pass

    def is_available(self) -> bool:
        return True

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Keep ``tensor``'s memory from reuse until ``stream``'s current work is done."""


class CUDADeviceHandle(CPUDeviceHandle):
    """Device handle for one CUDA device."""

    device_type = "cuda"
    is_accelerator = True

    def __init__(self, device: torch.device) -> None:
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
    return CUDADeviceHandle(device) if device.type == "cuda" else CPUDeviceHandle()


def install_device_handle(module: nn.Module, handle: DeviceHandle) -> None:
    """Make every FSDP instance under ``module`` use ``handle`` for streams and events.

    Call after wrapping and before the first forward (or between iterations).

    Raises:
        ValueError: no FSDP instance (``UsesDeviceHandle``) under ``module``.
    """
    instances = [m for m in module.modules() if isinstance(m, UsesDeviceHandle)]
    if not instances:
        raise ValueError(f"install_device_handle: no FSDP instance under {type(module).__name__}")
    for instance in instances:
        instance._use_device_handle(handle)
