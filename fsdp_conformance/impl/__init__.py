"""The reference FSDP: flat parameters, rate-limited all-gathers, forward/backward prefetch."""

from __future__ import annotations

from . import device, trace
from .api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardedFlatParameter,
    ShardingStrategy,
    StateDictType,
)
from .device import CPUDeviceHandle, CUDADeviceHandle, install_device_handle
from .fully_sharded import FullyShardedDataParallel
from .limiter import MAX_INFLIGHT
from .state import HandleTrainingState, TrainingState

FSDP = FullyShardedDataParallel

__all__ = [
    "FSDP",
    "MAX_INFLIGHT",
    "BackwardPrefetch",
    "CPUDeviceHandle",
    "CPUOffload",
    "CUDADeviceHandle",
    "FullyShardedDataParallel",
    "HandleTrainingState",
    "MixedPrecision",
    "ShardedFlatParameter",
    "ShardingStrategy",
    "StateDictType",
    "TrainingState",
    "device",
    "install_device_handle",
    "trace",
]
