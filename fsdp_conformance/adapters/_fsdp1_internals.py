"""Every torch FSDP1 internal the torch-fsdp1 adapter touches, found by feature detection.

``torch_fsdp1.py`` reads and patches private parts of ``torch.distributed.fsdp`` only through
the functions here. Each checks that the internal it needs is present (not a version string)
and raises ``FSDP1InternalsError`` -- one line naming what is missing, the torch running and
the releases verified -- when it is not.

Verified on torch 2.8.0, 2.13.0, 2.14.1 and 2.15.0 (``VERIFIED_ON``): the same shape on all:
``FlatParamHandle._all_gather_flat_param`` / ``_free_unsharded_flat_param`` /
``_get_padded_unsharded_flat_param`` / ``uses_sharded_strategy`` / ``_training_state`` /
``_device_handle``; ``_runtime_utils._reduce_grad`` / ``_reduce_grad_no_shard`` (called by
``_post_backward_hook`` through module globals); an instance's ``_handle``,
``_device_handle``, ``training_state`` and ``_assert_state``; ``TrainingState`` in
``fully_sharded_data_parallel``.
"""

from __future__ import annotations

from typing import Any

from ._internals import InternalsProbe
from ._support import TESTED_TORCH

VERIFIED_ON = TESTED_TORCH  # the compatibility matrix's releases (_support.py)


class FSDP1InternalsError(RuntimeError):
    """The torch running lacks an FSDP1 internal the torch-fsdp1 adapter relies on."""


_probe = InternalsProbe(
    "torch FSDP1",
    "fsdp_conformance/adapters/_fsdp1_internals.py",
    FSDP1InternalsError,
    VERIFIED_ON,
)
moved = _probe.moved  # the one error for a missing internal
require = _probe.require  # that error unless an object has every attribute named
_import = _probe.load  # a module or its attribute, or that error


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
    """``torch.distributed.fsdp._runtime_utils`` (holds ``_reduce_grad`` / ``_no_shard``)."""
    module = _import("torch.distributed.fsdp._runtime_utils")
    require(module, "_reduce_grad", "_reduce_grad_no_shard")
    return module


def training_state_enum() -> Any:
    """``TrainingState`` of an FSDP1 instance (root state)."""
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
    """(fqn relative to the instance, start in the flattened parameter, offset in the local
    shard, element count) of each original parameter with elements in this rank's shard of the
    FlatParameter (``_fqns``, ``_shard_param_infos``)."""
    flat = handle.flat_param
    require(flat, "_fqns", "_shard_param_infos")
    return [
        (fqn, info.intra_param_start_idx, info.offset_in_shard, info.numel_in_shard)
        for fqn, info in zip(flat._fqns, flat._shard_param_infos)
        if info.in_shard and info.numel_in_shard
    ]


def set_device_handle(instance: Any, handle: Any) -> None:
    """Point an instance (and its ``FlatParamHandle``) at ``handle``."""
    require(instance, "_device_handle")
    instance._device_handle = handle
    flat = handle_of(instance)
    if flat is not None:
        require(flat, "_device_handle")
        flat._device_handle = handle
