"""Observers: the lagging device and the residency tracker (DESIGN §5)."""

from __future__ import annotations

from .lagging import LAG_VARIANTS, LaggingDevice, LaggingEvent, LaggingStream
from .residency import PhasePeak, ResidencyTracker, Sample

__all__ = [
    "LAG_VARIANTS",
    "LaggingDevice",
    "LaggingEvent",
    "LaggingStream",
    "PhasePeak",
    "ResidencyTracker",
    "Sample",
]
