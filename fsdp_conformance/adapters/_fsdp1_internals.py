"""Every torch FSDP1 internal the torch-fsdp1 adapter touches, found by feature detection.

Each accessor checks that the internal is present (not a version string) and raises
``FSDP1InternalsError`` naming what is missing, the torch running and ``VERIFIED_ON`` (the same
shape on all of them).
"""

from __future__ import annotations

from typing import Any

from ._internals import InternalsProbe
from ._support import TESTED_TORCH

VERIFIED_ON = TESTED_TORCH


class FSDP1InternalsError(RuntimeError):
    """The torch running lacks an FSDP1 internal the torch-fsdp1 adapter relies on."""


_probe = InternalsProbe(
    "torch FSDP1", "fsdp_conformance/adapters/_fsdp1_internals.py", FSDP1InternalsError, VERIFIED_ON
)
moved = _probe.moved
require = _probe.require
_import = _probe.load


def flat_param_handle_class() -> type:
    cls = _import("torch.distributed.fsdp._flat_param", "FlatParamHandle")
    require(
        cls,
        "_all_gather_flat_param",
        "_free_unsharded_flat_param",
        "_get_padded_unsharded_flat_param",
        "uses_sharded_strategy",
    )
    return cls


def runtime_utils() -> Any:
    module = _import("torch.distributed.fsdp._runtime_utils")
    require(module, "_reduce_grad", "_reduce_grad_no_shard")
    return module


def training_state_enum() -> Any:
    return _import("torch.distributed.fsdp.fully_sharded_data_parallel", "TrainingState")


def handle_of(instance: Any) -> Any:
    """The instance's ``FlatParamHandle`` (None: the instance has no parameters)."""
    require(instance, "_handle")
    return instance._handle


def handle_training_state_name(handle: Any) -> str:
    require(handle, "_training_state")
    return handle._training_state.name


def root_training_state_name(instance: Any) -> str:
    require(instance, "training_state")
    return instance.training_state.name


def handle_is_unsharded(handle: Any) -> bool:
    if not handle.uses_sharded_strategy:
        return True  # NO_SHARD: the flat parameter is always whole
    return handle._get_padded_unsharded_flat_param().untyped_storage().size() > 0


def assert_state(instance: Any, state_names: list[str]) -> None:
    require(instance, "_assert_state")
    enum = training_state_enum()
    instance._assert_state([enum[name] for name in state_names])


def grad_shard_layout(handle: Any) -> list[tuple[str, int, int, int]]:
    """(fqn in the instance, start in the flattened parameter, offset in the local shard,
    count) of each original parameter with elements in this rank's shard."""
    flat = handle.flat_param
    require(flat, "_fqns", "_shard_param_infos")
    return [
        (fqn, info.intra_param_start_idx, info.offset_in_shard, info.numel_in_shard)
        for fqn, info in zip(flat._fqns, flat._shard_param_infos)
        if info.in_shard and info.numel_in_shard
    ]


def set_device_handle(instance: Any, handle: Any) -> None:
    require(instance, "_device_handle")
    instance._device_handle = handle
    flat = handle_of(instance)
    if flat is not None:
        require(flat, "_device_handle")
        flat._device_handle = handle
