"""The lagging device: a device-handle test double on which the CPU always runs ahead.

[Note: lagging device]
On a GPU the CPU enqueues work and runs ahead; a buffer freed by the CPU is reusable only once
the device has reached the free. On CPU every ``torch.cpu.Event`` is complete at once, so a
rate limiter that waits on free events is invisible. ``LaggingDevice`` models the slowest
possible device instead: an event completes only when the CPU blocks on it --
``event.synchronize()`` on that event or on a later one (events complete in recording order,
as on one CUDA stream), ``stream.synchronize()`` or ``device.synchronize()`` (everything
recorded so far). Variants:

- ``LaggingDevice("strict")``: never drains by itself (an infinitely slow device);
- ``LaggingDevice("drained")``: also catches up at ``end_iteration()``, as ``loss.item()``
  forces once per training step;
- ``max_lag=K`` (either variant): an event also completes once K more events have been recorded
  after it (a finite, realistic delay).

It implements the ``fsdp_conformance.device_handle.DeviceHandle`` protocol (``Event``,
``Stream``, ``stream``, ``current_stream``, ``synchronize``, ``is_available``,
``record_stream``) on its own, without the reference implementation's handles; that is also all
torch FSDP1 uses on a CPU host (torch 2.13.0), so adapters install it with
``Adapter.install_device_handle``. Listeners (``add_listener``) hear of every
advance of the device, so observers can sample memory at the moment the device catches up.

    device = LaggingDevice("strict")
    adapter.install_device_handle(model, device)
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
        # the device whose progress decides completion
        self.device = device
        # position in the device's recording order; None until recorded
        self.seq: int | None = None

    def record(self, stream: Any = None) -> None:
        """Enqueue the event at the current end of the device's work."""
        self.seq = self.device._next_seq()

    def query(self) -> bool:
        """Whether the device has reached this event (an unrecorded event is complete)."""
        return self.seq is None or self.seq <= self.device.completed

    def synchronize(self) -> None:
        """Block the CPU until the device reaches this event (and so every earlier one)."""
        if self.seq is not None:
            self.device._complete_through(self.seq, "event.synchronize")

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` wait for this event: ordering only, nothing completes."""

    def __repr__(self) -> str:
        state = "unrecorded" if self.seq is None else ("done" if self.query() else "pending")
        return f"LaggingEvent(seq={self.seq}, {state})"


class LaggingStream:
    """The device's one stream; synchronizing it completes everything recorded so far."""

    def __init__(self, device: LaggingDevice) -> None:
        # the device this stream belongs to
        self.device = device

    def wait_stream(self, stream: Any) -> None:
        """Ordering only: one stream, program order."""

    def wait_event(self, event: Any) -> None:
        """Ordering only: one stream, program order."""

    def record_event(self, event: Any = None) -> LaggingEvent:
        event = event if event is not None else LaggingEvent(self.device)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.device._complete_through(self.device.recorded, "stream.synchronize")

    def query(self) -> bool:
        return self.device.completed >= self.device.recorded


class OrderedStream(LaggingStream):
    """A named stream of a lagging device that remembers what it waited for.

    Args:
        device: the lagging device (events still complete in its one recording order).
        name: a label for messages.
    """

    def __init__(self, device: LaggingDevice, name: str = "stream") -> None:
        super().__init__(device)
        self.name = name  # label for messages
        self.waited = 0  # the latest device sequence number this stream waited for (0: none)

    def wait_event(self, event: Any) -> None:
        """Later work on this stream runs after ``event`` (recorded events only)."""
        seq = getattr(event, "seq", None)
        if seq is not None:
            self.waited = max(self.waited, seq)

    def wait_stream(self, stream: Any) -> None:
        """Later work on this stream runs after everything recorded so far."""
        self.waited = max(self.waited, self.device.recorded)

    def __repr__(self) -> str:
        return f"OrderedStream({self.name!r}, waited={self.waited})"


class LaggingDevice:
    """A device handle (``DeviceHandle``) whose events complete only when the CPU synchronizes
    on them.

    Args:
        variant: ``"strict"`` (never drains by itself) or ``"drained"`` (catches up at every
            ``end_iteration()``). See [Note: lagging device].
        max_lag: if given, an event also completes once ``max_lag`` more events have been
            recorded after it.
    """

    # the torch device type the double stands in for (a CPU host's compute)
    device_type = "cpu"
    # pinned host memory is meaningless on a CPU host
    is_accelerator = False

    def __init__(self, variant: str = "strict", max_lag: int | None = None) -> None:
        if variant not in LAG_VARIANTS:
            raise ValueError(f"LaggingDevice(variant={variant!r}): choose one of {LAG_VARIANTS}")
        if max_lag is not None and max_lag < 0:
            raise ValueError(f"LaggingDevice(max_lag={max_lag}): give None or a count >= 0")
        # "strict" or "drained"
        self.variant = variant
        # events recorded more than this many events ago are complete (None: never by itself)
        self.max_lag = max_lag
        # - Progress (sequence numbers start at 1; 0 means "nothing")
        # the last event recorded
        self.recorded = 0
        # every event with seq <= completed has completed on the device
        self.completed = 0
        # - Statistics
        # how many times the CPU blocked on the device (synchronize calls that completed work)
        self.blocking_syncs = 0
        # callbacks told of every advance of `completed`
        self._listeners: list[CompletionListener] = []
        # the one stream
        self._stream = LaggingStream(self)

    # ------------------------------------------------------------------ device-handle interface
    def Event(self, **kwargs: Any) -> LaggingEvent:
        """A new, unrecorded event (timing/IPC flags are accepted and ignored)."""
        return LaggingEvent(self)

    def ordered_stream(self, name: str = "stream") -> OrderedStream:
        """A named stream that remembers which event it was made to wait for (the stream-ordered
        reuse rule of ``observe.stream_order`` reads it)."""
        return OrderedStream(self, name)

    def Stream(self, **kwargs: Any) -> LaggingStream:
        """The device's one stream (priority is accepted and ignored)."""
        return self._stream

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def current_stream(self) -> LaggingStream:
        return self._stream

    def synchronize(self) -> None:
        """Block until the device has done everything recorded so far."""
        self._complete_through(self.recorded, "device.synchronize")

    def is_available(self) -> bool:
        return True

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Nothing to protect: the double models completion, not allocation."""

    # ------------------------------------------------------------------ driver interface
    def end_iteration(self) -> None:
        """The training step's end: the drained variant catches up (as ``loss.item()`` forces)."""
        if self.variant == "drained":
            self._complete_through(self.recorded, "end_iteration")

    def add_listener(self, listener: CompletionListener) -> None:
        """Call ``listener(device, reason)`` after every advance of ``completed``."""
        self._listeners.append(listener)

    def remove_listener(self, listener: CompletionListener) -> None:
        self._listeners.remove(listener)

    @property
    def pending(self) -> int:
        """Events recorded but not yet complete."""
        return self.recorded - self.completed

    # ------------------------------------------------------------------ internals
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
