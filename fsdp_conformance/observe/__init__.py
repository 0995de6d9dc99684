"""Observers: the lagging device and the residency tracker (DESIGN §5); the training-state
recorder (DESIGN §4)."""

from __future__ import annotations

from .lagging import LAG_VARIANTS, LaggingDevice, LaggingEvent, LaggingStream
from .residency import PhasePeak, ResidencyTracker, Sample
from .states import IllegalTrainingState, TrainingStateRecorder, Violation

__all__ = [
    "LAG_VARIANTS",
    "IllegalTrainingState",
    "LaggingDevice",
    "LaggingEvent",
    "LaggingStream",
    "PhasePeak",
    "ResidencyTracker",
    "Sample",
    "TrainingStateRecorder",
    "Violation",
]
