"""The lagging device: a device-handle test double on which the CPU always runs ahead.

[Note: lagging device]
On CPU every event is complete at once, so a rate limiter waiting on free events is invisible.
``LaggingDevice`` models the slowest device instead: an event completes only when the CPU
blocks on it or on a later one (events complete in recording order, as on one CUDA stream), or
on the stream or device. ``"strict"`` never drains by itself; ``"drained"`` also catches up at
``end_iteration()`` (as ``loss.item()`` forces); ``max_lag=K`` also completes an event once K
more have been recorded. It implements the ``DeviceHandle`` protocol on its own (all torch FSDP1
uses on a CPU host; ``adapter.install_device_handle``); listeners hear of every advance.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

LAG_VARIANTS = ("strict", "drained")

# listener(device, reason): the device's completed sequence number has just advanced
CompletionListener = Callable[["LaggingDevice", str], None]


class LaggingEvent:
    """An event of a ``LaggingDevice``: complete once the device has reached it."""

    def __init__(self, device: LaggingDevice) -> None:
        self.device = device
        self.seq: int | None = None  # position in the recording order; None until recorded

    def record(self, stream: Any = None) -> None:
        self.seq = self.device._next_seq()

    def query(self) -> bool:
        """An unrecorded event is complete."""
        return self.seq is None or self.seq <= self.device.completed

    def synchronize(self) -> None:
        if self.seq is not None:
            self.device._complete_through(self.seq, "event.synchronize")

    def wait(self, stream: Any = None) -> None:
        """Ordering only: nothing completes."""

    def __repr__(self) -> str:
        state = "unrecorded" if self.seq is None else ("done" if self.query() else "pending")
        return f"LaggingEvent(seq={self.seq}, {state})"


class LaggingStream:
    """The device's one stream; synchronizing it completes everything recorded so far."""

    def __init__(self, device: LaggingDevice) -> None:
        self.device = device

    def wait_stream(self, stream: Any) -> None:
        """Ordering only: one stream, program order."""

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> LaggingEvent:
        event = event if event is not None else LaggingEvent(self.device)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.device._complete_through(self.device.recorded, "stream.synchronize")

    def query(self) -> bool:
        return self.device.completed >= self.device.recorded


class OrderedStream(LaggingStream):
    """A named stream of a lagging device that remembers what it waited for (events still
    complete in the device's one recording order)."""

    def __init__(self, device: LaggingDevice, name: str = "stream") -> None:
        super().__init__(device)
        self.name = name
        self.waited = 0  # the latest device sequence number this stream waited for (0: none)

    def wait_event(self, event: Any) -> None:
        if (seq := getattr(event, "seq", None)) is not None:
            self.waited = max(self.waited, seq)

    def wait_stream(self, stream: Any) -> None:
        self.waited = max(self.waited, self.device.recorded)

    def __repr__(self) -> str:
        return f"OrderedStream({self.name!r}, waited={self.waited})"


class LaggingDevice:
    """A device handle whose events complete only when the CPU synchronizes on them (variants:
    [Note: lagging device])."""

    device_type = "cpu"
    is_accelerator = False

    def __init__(self, variant: str = "strict", max_lag: int | None = None) -> None:
        if variant not in LAG_VARIANTS:
            raise ValueError(f"LaggingDevice(variant={variant!r}): choose one of {LAG_VARIANTS}")
        if max_lag is not None and max_lag < 0:
            raise ValueError(f"LaggingDevice(max_lag={max_lag}): give None or a count >= 0")
        self.variant = variant
        self.max_lag = max_lag
        # sequence numbers start at 1: the last event recorded, and the last one complete
        self.recorded = 0
        self.completed = 0
        # synchronize calls that completed work
        self.blocking_syncs = 0
        self._listeners: list[CompletionListener] = []
        self._stream = LaggingStream(self)

    def Event(self, **kwargs: Any) -> LaggingEvent:
        return LaggingEvent(self)

    def ordered_stream(self, name: str = "stream") -> OrderedStream:
        """A stream that remembers which event it waited for (``observe.stream_order``)."""
        return OrderedStream(self, name)

    def Stream(self, **kwargs: Any) -> LaggingStream:
        return self._stream

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def current_stream(self) -> LaggingStream:
        return self._stream

    def synchronize(self) -> None:
        self._complete_through(self.recorded, "device.synchronize")

    def is_available(self) -> bool:
        return True

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """The double models completion, not allocation."""

    def end_iteration(self) -> None:
        """The training step's end: the drained variant catches up."""
        if self.variant == "drained":
            self._complete_through(self.recorded, "end_iteration")

    def add_listener(self, listener: CompletionListener) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: CompletionListener) -> None:
        self._listeners.remove(listener)

    @property
    def pending(self) -> int:
        return self.recorded - self.completed

    def _next_seq(self) -> int:
        self.recorded += 1
        if self.max_lag is not None and self.recorded - self.max_lag > self.completed:
            self._advance(self.recorded - self.max_lag, "max_lag")
        return self.recorded

    def _complete_through(self, seq: int, reason: str) -> None:
        if seq > self.completed:
            self.blocking_syncs += 1
            self._advance(seq, reason)

    def _advance(self, seq: int, reason: str) -> None:
        self.completed = seq
        for listener in tuple(self._listeners):
            listener(self, reason)

    def __repr__(self) -> str:
        lag = "" if self.max_lag is None else f", max_lag={self.max_lag}"
        return (
            f"LaggingDevice({self.variant!r}{lag}; recorded={self.recorded}, "
            f"completed={self.completed})"
        )
