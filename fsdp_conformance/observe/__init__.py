"""Observers: the lagging device and the residency tracker (unsharded buffers resident until
their free completes on the device); the training-state recorder (the canonical transitions of
``fsdp_conformance/training_states.py``)."""

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
