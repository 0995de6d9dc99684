"""Residency of unsharded buffers, observed through an adapter's comm trace and a lagging device.

[Note: residency]
An instance's unsharded buffer is *resident* from the moment its all-gather is issued (the
output is allocated) until the free recorded at its reshard has *completed on the device*
(``observe/lagging.py`` models a device that lags the CPU). The tracker is an adapter observer (``adapter.observe(tracker)``): on
``"all_gather"`` the instance gains a live buffer; on ``"free"`` the buffer stops being live
and the tracker records a marker event on the lagging device right there, in stream order;
the buffer stays resident until that marker completes (the CPU synchronized on it, on a later
event, or on the device). Recording our own marker makes the observation independent of
whether the implementation records a free event at all (torch FSDP1 records none with
``limit_all_gathers=False``); events complete in order, so an implementation's own free event,
recorded right after the free, completes the marker with it.

Stream-ordered implementations (torch FSDP2) report their buffers one by one: ``info`` of an
``"all_gather"``, ``"alloc"`` (a buffer allocated outside the all-gather, e.g. unsharded
parameters filled by a copy-out) or ``"free"`` names the ``"stream"`` the buffer was allocated
on and, at the free, ``"used_after"`` (the device's last recorded event when another stream last
used it, or None). Such a free is reusable at once when the allocating stream is ordered after
every other use ([Note: stream-ordered reuse] in ``fsdp_conformance.observe.stream_order``);
otherwise it drains like the rest. Without ``"stream"`` a free is the ``record_stream`` case
above (allocated on the unshard stream, used by the compute stream), so the numbers of
implementations that report no streams are those of the marker rule.

Counts: ``resident`` is the number of resident non-root buffers; the root's buffers
(``root_resident``) are reported separately, since FULL_SHARD keeps the root unsharded between
forward and backward. A phase's *peak* is the largest ``resident`` right after an all-gather
issued in that phase -- residency only rises at an issue, so this is the memory the phase itself
asked for; buffers still draining from the previous phase count only if the phase issues more.

Every event is also a ``Sample`` in ``samples`` (the time series the CLI timeline plots):

    tracker = ResidencyTracker(device, adapter.instances(model))
    with adapter.observe(tracker):
        for iteration in range(1, 4):
            tracker.start(iteration, "forward"); loss = loss_of(model(x))
            tracker.start(iteration, "backward"); loss.backward()
            tracker.start(iteration, "step"); optim.step(); device.end_iteration()
    tracker.peaks[(2, "backward")].resident
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

from torch import nn

from fsdp_conformance.constants import Op
from fsdp_conformance.observe.lagging import LaggingDevice, LaggingEvent
from fsdp_conformance.observe.stream_order import reusable_at_free

PHASES = ("forward", "backward")


class Sample(NamedTuple):
    """Residency right after one event."""

    # position in the observed event sequence (0, 1, ...)
    index: int
    # training iteration (1-based) set by the driver; 0 before the first `start`
    iteration: int
    # "forward", "backward", or another driver-chosen label (e.g. "step")
    phase: str
    # "all_gather", "alloc", "free", "complete" (the device caught up), or "start" (phase began)
    op: str
    # label of the instance the op belongs to ("" for "complete" and "start")
    instance: str
    # resident non-root unsharded buffers after the event
    resident: int
    # resident root buffers after the event
    root_resident: int


@dataclasses.dataclass
class PhasePeak:
    """The largest non-root residency right after an all-gather issued in one phase."""

    # peak resident non-root buffers (0 if the phase issued no non-root all-gather)
    resident: int = 0
    # label of the instance whose all-gather reached the peak first
    at_instance: str = ""
    # `Sample.index` where the peak was first reached
    at_index: int = -1
    # the most root buffers resident at any event of the phase
    root_resident: int = 0
    # non-root all-gathers issued in the phase
    all_gathers: int = 0


class ResidencyTracker:
    """Counts resident unsharded buffers per instance (see [Note: residency]).

    Args:
        device: the lagging device installed in the model (markers are recorded on it, and
            its completions are sampled).
        instances: the model's FSDP instances, pre-order (``adapter.instances(model)``).
        root: the root instance; default ``instances[0]``.
    """

    # Adapters that report buffers per stream send them to this observer one by one
    buffer_events = True

    def __init__(
        self, device: LaggingDevice, instances: Sequence[nn.Module], root: nn.Module | None = None
    ) -> None:
        if not instances:
            raise ValueError(
                "ResidencyTracker: no FSDP instances given; pass adapter.instances(model)"
            )
        # the lagging device the model runs on
        self.device = device
        # the root instance (reported separately)
        self.root = instances[0] if root is None else root
        # id(instance) -> label: "root" or "<position in pre-order>:<module class>"
        self.labels: dict[int, str] = {}
        for position, instance in enumerate(instances):
            inner = getattr(instance, "module", instance)
            self.labels[id(instance)] = (
                "root" if instance is self.root else f"{position}:{type(inner).__name__}"
            )
        # - Buffer state
        # label -> number of live (allocated, not yet freed by the CPU) unsharded buffers
        self.live: dict[str, int] = {}
        # (label, marker) for each freed buffer whose free may not have completed yet
        self.draining: list[tuple[str, LaggingEvent]] = []
        # - Driver state
        # current iteration and phase (set by `start`)
        self.iteration = 0
        self.phase = ""
        # - Results
        # every event, in order (the time series)
        self.samples: list[Sample] = []
        # (iteration, phase) -> its peak
        self.peaks: dict[tuple[int, str], PhasePeak] = {}
        device.add_listener(self._on_device_progress)

    # ------------------------------------------------------------------ driver
    def start(self, iteration: int, phase: str) -> None:
        """Attribute what follows to ``iteration`` (1-based) and ``phase``."""
        self.iteration = iteration
        self.phase = phase
        self.peaks.setdefault((iteration, phase), PhasePeak())
        self._sample("start", "")

    def close(self) -> None:
        """Stop listening to the device."""
        self.device.remove_listener(self._on_device_progress)

    # ------------------------------------------------------------------ observer
    def __call__(self, op: str, instance: nn.Module, info: dict[str, Any]) -> None:
        """The adapter observer: ``callback(op, instance, info)``."""
        if op in (Op.ALL_GATHER, Op.ALLOC):
            label = self.label(instance)
            self.live[label] = self.live.get(label, 0) + 1
            sample = self._sample(op, label)
            if instance is not self.root:
                self._note_peak(sample, all_gather=op == Op.ALL_GATHER)
        elif op == Op.FREE:
            label = self.label(instance)
            if self.live.get(label, 0) == 0:
                raise AssertionError(
                    f"ResidencyTracker: {label} freed an unsharded buffer it never all-gathered "
                    "(was the tracker attached after the first forward?)"
                )
            self.live[label] -= 1
            if "stream" not in info or not reusable_at_free(info["stream"], info.get("used_after")):
                marker = self.device.Event()
                marker.record()
                self.draining.append((label, marker))
            self._sample(op, label)

    # ------------------------------------------------------------------ queries
    def label(self, instance: nn.Module) -> str:
        """The instance's label (instances not given at construction get their class name)."""
        return self.labels.get(id(instance)) or f"?:{type(instance).__name__}"

    def resident_by_instance(self) -> dict[str, int]:
        """Label -> resident buffers right now (live + freed but not complete)."""
        counts = {label: count for label, count in self.live.items() if count}
        for label, marker in self.draining:
            if not marker.query():
                counts[label] = counts.get(label, 0) + 1
        return counts

    def resident(self) -> tuple[int, int]:
        """(non-root, root) resident buffers right now."""
        by_instance = self.resident_by_instance()
        root = by_instance.pop("root", 0)
        return sum(by_instance.values()), root

    def peak(self, iteration: int, phase: str) -> PhasePeak:
        """The peak of one phase (a zero peak if it was never started)."""
        return self.peaks.get((iteration, phase), PhasePeak())

    def rows(self) -> list[dict[str, Any]]:
        """The time series as plain dicts (JSON-ready)."""
        return [sample._asdict() for sample in self.samples]

    def peak_table(self) -> str:
        """``iteration phase peak`` lines for every phase started, in order."""
        return "\n".join(
            f"{iteration} {phase} {peak.resident}"
            for (iteration, phase), peak in self.peaks.items()
        )

    # ------------------------------------------------------------------ internals
    def _on_device_progress(self, device: LaggingDevice, reason: str) -> None:
        self.draining = [(label, marker) for label, marker in self.draining if not marker.query()]
        self._sample("complete", "")

    def _sample(self, op: str, label: str) -> Sample:
        resident, root_resident = self.resident()
        sample = Sample(
            len(self.samples), self.iteration, self.phase, op, label, resident, root_resident
        )
        self.samples.append(sample)
        peak = self.peaks.get((self.iteration, self.phase))
        if peak is not None:
            peak.root_resident = max(peak.root_resident, root_resident)
        return sample

    def _note_peak(self, sample: Sample, all_gather: bool = True) -> None:
        peak = self.peaks.setdefault((self.iteration, self.phase), PhasePeak())
        peak.all_gathers += all_gather
        if sample.resident > peak.resident:
            peak.resident = sample.resident
            peak.at_instance = sample.instance
            peak.at_index = sample.index
