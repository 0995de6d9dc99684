"""Every torch FSDP2 internal the torch-fsdp2 adapter touches, found by feature detection.

Each accessor looks for the shapes it knows (not a version string) and raises
``FSDP2InternalsError`` naming what is missing, the torch running and ``VERIFIED_ON``. A shape
that differs: an ``FSDPState``'s ``_fsdp_param_groups`` (2.13 on) or ``_fsdp_param_group`` (2.8).
"""

from __future__ import annotations

from typing import Any

from ._internals import InternalsProbe
from ._support import TESTED_TORCH

VERIFIED_ON = TESTED_TORCH
# FSDPCommContext's streams, replaced by lagging-device streams at lazy init
COMM_STREAMS = (
    "all_gather_copy_in_stream",
    "all_gather_stream",
    "reduce_scatter_stream",
    "all_reduce_stream",
)


class FSDP2InternalsError(RuntimeError):
    """The torch running lacks an FSDP2 internal the torch-fsdp2 adapter relies on."""


_probe = InternalsProbe(
    "torch FSDP2", "fsdp_conformance/adapters/_fsdp2_internals.py", FSDP2InternalsError, VERIFIED_ON
)
moved = _probe.moved
require = _probe.require
_import = _probe.load


def param_group_class() -> type:
    cls = _import("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup")
    require(cls, "unshard", "wait_for_unshard", "reshard", "post_backward", "is_unsharded")
    return cls


def training_state_enum() -> Any:
    enum = _import("torch.distributed.fsdp._fully_shard._fsdp_common", "TrainingState")
    require(enum, "IDLE", "FORWARD", "PRE_BACKWARD", "POST_BACKWARD")
    return enum


def fsdp_state(module: Any) -> Any:
    require(module, "_get_fsdp_state")
    return module._get_fsdp_state()


def param_groups(state: Any) -> list[Any]:
    """The ``FSDPParamGroup``s of an ``FSDPState`` (empty without parameters)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    if hasattr(state, "_fsdp_param_group"):
        group = state._fsdp_param_group
        return [] if group is None else [group]
    raise moved("FSDPState has neither _fsdp_param_groups nor _fsdp_param_group")


def module_param_groups(module: Any) -> list[Any]:
    return param_groups(fsdp_state(module))


def all_gather_result(group: Any) -> Any:
    require(group, "_all_gather_result")
    return group._all_gather_result


def set_all_gather_result(group: Any, result: Any) -> None:
    group._all_gather_result = result


def training_state(obj: Any) -> Any:
    require(obj, "_training_state")
    return obj._training_state


def reshards_after_forward(group: Any) -> bool:
    require(group, "_reshard_after_forward")
    return bool(group._reshard_after_forward)


def all_gather_group_size(group: Any) -> int:
    require(group, "_all_gather_process_group")
    return group._all_gather_process_group.size()


def all_gather_copy_in_stream(group: Any, async_op: bool) -> Any:
    require(group, "comm_ctx")
    copy_in, _ = group.comm_ctx.get_all_gather_streams(async_op, training_state(group))
    return copy_in


def comm_context(state: Any) -> Any:
    """The ``FSDPCommContext`` of an ``FSDPState`` (with ``_device_handle`` and ``_is_root``)."""
    require(state, "_device_handle", "_comm_ctx", "_is_root")
    return state._comm_ctx


def set_device_handle(state: Any, handle: Any) -> None:
    comm_context(state)
    state._device_handle = handle
    for group in param_groups(state):
        require(group, "device_handle")
        group.device_handle = handle


def is_root(state: Any) -> bool | None:
    require(state, "_is_root")
    return state._is_root


def has_grads_to_reduce(group: Any) -> bool:
    """Whether `group`'s post-backward has a gradient to reduce (accumulated or ``.grad``)."""
    require(group, "fsdp_params")
    for fsdp_param in group.fsdp_params:
        if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
            return True
        if hasattr(fsdp_param, "_unsharded_param") and fsdp_param.unsharded_param.grad is not None:
            return True
    return False
