"""Residency of unsharded buffers, observed through an adapter's comm trace and a lagging device.

[Note: residency]
A buffer is *resident* from its all-gather (or ``"alloc"``) until the free recorded at its
reshard has *completed on the device* (``observe/lagging.py``): at ``"free"`` the tracker records
its own marker event, so it does not depend on the implementation recording one (torch FSDP1
without ``limit_all_gathers`` records none); events complete in order. A free whose ``info``
names the allocating ``"stream"`` (and ``"used_after"``) is reusable at once when that stream is
ordered after every other use ([Note: stream-ordered reuse]). ``resident`` counts non-root
buffers (``root_resident`` the root's); a phase's *peak* is the largest ``resident`` right after
an all-gather issued in it. Every event is also a ``Sample``. The driver calls
``tracker.start(iteration, phase)`` before each phase, inside ``adapter.observe(tracker)``.
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
    """Residency right after one event (``op``: an observed op, ``"complete"`` when the device
    caught up or ``"start"`` of a phase; ``instance`` is "" for those two)."""

    index: int
    iteration: int  # 0 before the first `start`
    phase: str
    op: str
    instance: str
    resident: int
    root_resident: int


@dataclasses.dataclass
class PhasePeak:
    """The largest non-root residency right after an all-gather issued in one phase, where it
    was first reached, the most root buffers at any event, and the non-root all-gathers."""

    resident: int = 0
    at_instance: str = ""
    at_index: int = -1
    root_resident: int = 0
    all_gathers: int = 0


class ResidencyTracker:
    """Counts resident unsharded buffers per instance (see [Note: residency]) of ``instances``
    (pre-order; ``root`` default: the first) on the lagging ``device`` installed in the model."""

    # adapters that report buffers per stream send them to this observer one by one
    buffer_events = True

    def __init__(
        self, device: LaggingDevice, instances: Sequence[nn.Module], root: nn.Module | None = None
    ) -> None:
        if not instances:
            raise ValueError(
                "ResidencyTracker: no FSDP instances given; pass adapter.instances(model)"
            )
        self.device = device
        self.root = instances[0] if root is None else root
        # id(instance) -> "root" or "<position in pre-order>:<module class>"
        self.labels: dict[int, str] = {}
        for position, instance in enumerate(instances):
            inner = getattr(instance, "module", instance)
            self.labels[id(instance)] = (
                "root" if instance is self.root else f"{position}:{type(inner).__name__}"
            )
        self.live: dict[str, int] = {}  # label -> buffers allocated, not yet freed by the CPU
        # (label, marker) for each freed buffer whose free may not have completed yet
        self.draining: list[tuple[str, LaggingEvent]] = []
        self.iteration = 0
        self.phase = ""
        self.samples: list[Sample] = []
        self.peaks: dict[tuple[int, str], PhasePeak] = {}
        device.add_listener(self._on_device_progress)

    def start(self, iteration: int, phase: str) -> None:
        """Attribute what follows to ``iteration`` (1-based) and ``phase``."""
        self.iteration = iteration
        self.phase = phase
        self.peaks.setdefault((iteration, phase), PhasePeak())
        self._sample("start", "")

    def close(self) -> None:
        self.device.remove_listener(self._on_device_progress)

    def __call__(self, op: str, instance: nn.Module, info: dict[str, Any]) -> None:
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
        return [sample._asdict() for sample in self.samples]

    def peak_table(self) -> str:
        """``iteration phase peak`` lines for every phase started, in order."""
        return "\n".join(
            f"{iteration} {phase} {peak.resident}"
            for (iteration, phase), peak in self.peaks.items()
        )

    def _on_device_progress(self, device: LaggingDevice, reason: str) -> None:
        self.draining = [(label, marker) for label, marker in self.draining if not marker.query()]
        self._sample("complete", "")

    def _sample(self, op: str, label: str) -> Sample:
        sample = Sample(len(self.samples), self.iteration, self.phase, op, label, *self.resident())
        self.samples.append(sample)
        if (peak := self.peaks.get((self.iteration, self.phase))) is not None:
            peak.root_resident = max(peak.root_resident, sample.root_resident)
        return sample

    def _note_peak(self, sample: Sample, all_gather: bool = True) -> None:
        peak = self.peaks.setdefault((self.iteration, self.phase), PhasePeak())
        peak.all_gathers += all_gather
        if sample.resident > peak.resident:
            peak.resident = sample.resident
            peak.at_instance = sample.instance
            peak.at_index = sample.index
