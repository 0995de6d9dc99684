"""Every torch FSDP2 internal the torch-fsdp2 adapter touches, found by feature detection.

The adapter (``torch_fsdp2.py``, ``_fsdp2_device.py``, ``_fsdp2_prefetch.py``) reads and
patches private parts of ``torch.distributed.fsdp._fully_shard``; it does so only through the
functions here. Each looks for the internals it knows (not for a version string) and raises
``FSDP2InternalsError`` -- one line naming what is missing, the torch running and the releases
this file was verified on -- when none of the known shapes is present.

Verified on torch 2.8.0, 2.13.0, 2.14.1 and 2.15.0 (``VERIFIED_ON``). The shapes known:

- an ``FSDPState``'s parameter groups: ``_fsdp_param_groups`` (a list; 2.13 on) or the single
  ``_fsdp_param_group`` (an ``FSDPParamGroup`` or None; 2.8);
- the wait of both all-gather streams on the previous copy-out event:
  ``FSDPParamGroup._wait_all_gather_streams_on_event`` (up to 2.14) or
  ``FSDPCommContext.wait_all_gather_streams_on_event`` (2.15);
- ``FSDPParamGroup.unshard`` / ``wait_for_unshard`` / ``reshard`` / ``post_backward`` /
  ``_to_unsharded`` / ``_to_sharded`` / ``_to_sharded_post_forward`` / ``is_unsharded`` /
  ``_all_gather_result`` / ``_training_state`` / ``_reshard_after_forward`` /
  ``device_handle`` / ``comm_ctx`` (every verified release);
- ``FSDPState._device_handle`` / ``_comm_ctx`` / ``_is_root`` / ``_training_state`` and
  ``FSDPCommContext.lazy_init`` / ``get_all_gather_streams`` and its four streams.
"""

from __future__ import annotations

from typing import Any

from ._internals import InternalsProbe
from ._support import TESTED_TORCH

# The torch releases every accessor below was run on (docs/compatibility.md)
VERIFIED_ON = TESTED_TORCH  # the compatibility matrix's releases (_support.py)
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
    "torch FSDP2",
    "fsdp_conformance/adapters/_fsdp2_internals.py",
    FSDP2InternalsError,
    VERIFIED_ON,
)
moved = _probe.moved  # the one error for a missing internal
require = _probe.require  # that error unless an object has every attribute named
_import = _probe.load  # a module or its attribute, or that error


# ---------------------------------------------------------------------------- classes
def param_group_class() -> type:
    """``FSDPParamGroup``."""
    cls = _import("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup")
    require(cls, "unshard", "wait_for_unshard", "reshard", "post_backward", "is_unsharded")
    return cls


def comm_context_class() -> type:
    """``FSDPCommContext``."""
    cls = _import("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPCommContext")
    require(cls, "lazy_init", "get_all_gather_streams")
    return cls


def training_state_enum() -> Any:
    """FSDP2's ``TrainingState`` enum (of ``FSDPState`` and ``FSDPParamGroup``)."""
    enum = _import("torch.distributed.fsdp._fully_shard._fsdp_common", "TrainingState")
    require(enum, "IDLE", "FORWARD", "PRE_BACKWARD", "POST_BACKWARD")
    return enum


def stream_wait_target() -> tuple[type, str]:
    """``(owner class, attribute)`` of the wait of both all-gather streams on an event.

    The call that orders the next all-gather after the previous copy-out (stream-ordered reuse
    of all-gather outputs): an ``FSDPParamGroup`` method up to torch 2.14, an
    ``FSDPCommContext`` method from 2.15.
    """
    group = param_group_class()
    if hasattr(group, "_wait_all_gather_streams_on_event"):
        return group, "_wait_all_gather_streams_on_event"
    context = comm_context_class()
    if hasattr(context, "wait_all_gather_streams_on_event"):
        return context, "wait_all_gather_streams_on_event"
    raise moved(
        "neither FSDPParamGroup._wait_all_gather_streams_on_event nor "
        "FSDPCommContext.wait_all_gather_streams_on_event exists"
    )


def releases_previous_output_before_copy_out() -> bool:
    """Whether a forward unshard drops the previous instance's all-gather output before its own
    copy-out (torch 2.15: ``FSDPCommContext.release_all_gather_state_for_comm_reuse``) rather
    than when its wait returns (up to 2.14): one all-gather output fewer in flight in a forward
    without explicit prefetch."""
    return hasattr(comm_context_class(), "release_all_gather_state_for_comm_reuse")


# ---------------------------------------------------------------------------- instances
def fsdp_state(module: Any) -> Any:
    """The ``FSDPState`` of a ``fully_shard``-ed module."""
    require(module, "_get_fsdp_state")
    return module._get_fsdp_state()


def param_groups(state: Any) -> list[Any]:
    """The ``FSDPParamGroup``s of one ``FSDPState`` (empty when it manages no parameters)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    if hasattr(state, "_fsdp_param_group"):
        group = state._fsdp_param_group
        return [] if group is None else [group]
    raise moved("FSDPState has neither _fsdp_param_groups nor _fsdp_param_group")


def module_param_groups(module: Any) -> list[Any]:
    """The ``FSDPParamGroup``s of a ``fully_shard``-ed module."""
    return param_groups(fsdp_state(module))


def all_gather_result(group: Any) -> Any:
    """The group's pending ``AllGatherResult`` (None when no all-gather is pending)."""
    require(group, "_all_gather_result")
    return group._all_gather_result


def set_all_gather_result(group: Any, result: Any) -> None:
    group._all_gather_result = result


def training_state(obj: Any) -> Any:
    """``_training_state`` of an ``FSDPState`` or ``FSDPParamGroup``."""
    require(obj, "_training_state")
    return obj._training_state


def reshards_after_forward(group: Any) -> bool:
    require(group, "_reshard_after_forward")
    return bool(group._reshard_after_forward)


def all_gather_group_size(group: Any) -> int:
    """World size of the group's all-gather (1: nothing is gathered)."""
    require(group, "_all_gather_process_group")
    return group._all_gather_process_group.size()


def all_gather_copy_in_stream(group: Any, async_op: bool) -> Any:
    """The stream the group's next all-gather output is allocated on."""
    require(group, "comm_ctx")
    copy_in, _ = group.comm_ctx.get_all_gather_streams(async_op, training_state(group))
    return copy_in


def comm_context(state: Any) -> Any:
    """The ``FSDPCommContext`` of an ``FSDPState`` (which must also keep ``_device_handle`` and
    ``_is_root``, replaced and read by the lagging-device install)."""
    require(state, "_device_handle", "_comm_ctx", "_is_root")
    return state._comm_ctx


def set_device_handle(state: Any, handle: Any) -> None:
    """Point an ``FSDPState`` and its parameter groups at ``handle``."""
    comm_context(state)
    state._device_handle = handle
    for group in param_groups(state):
        require(group, "device_handle")
        group.device_handle = handle


def is_root(state: Any) -> bool | None:
    require(state, "_is_root")
    return state._is_root


def has_grads_to_reduce(group: Any) -> bool:
    """Whether FSDP2's post-backward of param group `group` has a gradient to reduce: an
    accumulated unsharded gradient or the unsharded parameter's ``.grad`` (torch 2.13.0-2.15)."""
    require(group, "fsdp_params")
    for fsdp_param in group.fsdp_params:
        if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
            return True
        if hasattr(fsdp_param, "_unsharded_param") and fsdp_param.unsharded_param.grad is not None:
            return True
    return False
