"""The reference FSDP: flat parameters, rate-limited all-gathers, forward/backward prefetch."""

from __future__ import annotations

from fsdp_conformance.impl import device, trace
from fsdp_conformance.impl.api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardedFlatParameter,
    ShardingStrategy,
    StateDictType,
)
from fsdp_conformance.impl.device import CPUDeviceHandle, CUDADeviceHandle, install_device_handle
from fsdp_conformance.impl.fully_sharded import FullyShardedDataParallel
from fsdp_conformance.impl.limiter import MAX_INFLIGHT
from fsdp_conformance.impl.state import HandleTrainingState, TrainingState

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
