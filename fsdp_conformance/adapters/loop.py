"""The training loop around a wrapped model: each function does what a torch user does
(``loss.backward()``, ``torch.optim.SGD(model.parameters())`` ...) unless the adapter overrides
the `EngineHooks` hook of that name (an engine such as DeepSpeed)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fsdp_conformance.training_states import RootState

from .base import (
    GroupOptions,
    UnsupportedFeatureError,
    _group_size,
    _primitive,
    clean_param_name,
    delay_before_free,  # noqa: F401 -- loop.delay_before_free/_reduction: part of the loop
    delay_before_reduction,  # noqa: F401
    group_by,
)
from .features import Feature, declared, own_member, require, stand_in, unmapped

_OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def optimizer_class(adapter: Any, name: str) -> type[torch.optim.Optimizer]:
    if name not in _OPTIMIZERS:
        raise ValueError(
            f"{adapter.name} optimizer: unknown optimizer {name!r}; use one of "
            f"{sorted(_OPTIMIZERS)}"
        )
    return _OPTIMIZERS[name]


class EngineHooks:
    """The training-loop hooks an adapter may override (``class A(EngineHooks, Adapter)``;
    ``super()`` is the plain behaviour)."""

    name: str

    def optimizer(
        self,
        model: nn.Module,
        name: str = "sgd",
        *,
        param_groups: GroupOptions | None = None,
        **hyperparameters: Any,
    ) -> torch.optim.Optimizer:
        """Torch's optimizer over `model.parameters()`; `param_groups(name, param) -> dict` gives
        group options by the unwrapped model's names (needs `param_groups`)."""
        optimizer_type = optimizer_class(self, name)
        if param_groups is None:
            return optimizer_type(model.parameters(), **hyperparameters)
        require(self, Feature.PARAM_GROUPS)
        segments = declared(self).wrapper_segments
        named = (
            (clean_param_name(param_name, segments), param)
            for param_name, param in model.named_parameters()
        )
        return optimizer_type(group_by(named, param_groups), **hyperparameters)

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        loss.backward()

    def accumulation_boundary(self, model: nn.Module, boundary: bool) -> None:
        """Before each micro-batch's forward of an accumulating step; `boundary`: the last one."""

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Context manager: a backward inside accumulates gradients without reducing them."""
        require(self, Feature.GRADIENT_ACCUMULATION)
        method = getattr(model, "no_sync", None)
        if method is None:
            raise UnsupportedFeatureError(
                self.name,
                Feature.GRADIENT_ACCUMULATION,
                f"the root {type(model).__name__} has no no_sync(); override Adapter.no_sync",
            )
        return method()

    def clip_grad_norm_(
        self, model: nn.Module, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip the gradients by their global norm; the norm before clipping (as torch's
        ``clip_grad_norm_`` over the unsharded model)."""
        require(self, Feature.CLIP_GRAD_NORM)
        method = getattr(model, "clip_grad_norm_", None)
        if method is None:
            raise UnsupportedFeatureError(
                self.name,
                Feature.CLIP_GRAD_NORM,
                f"the root {type(model).__name__} has no clip_grad_norm_(); override "
                "Adapter.clip_grad_norm_",
            )
        return method(max_norm, norm_type)

    def grad_scaler(self, model: nn.Module, **options: Any) -> Any:
        """The gradient scaler users pair with `model` (``torch.amp.GradScaler``'s protocol); it
        skips the step on every rank when any rank's shard holds an inf or NaN."""
        unmapped(
            self,
            Feature.GRAD_SCALER,
            "override Adapter.grad_scaler (return the scaler users pair with this "
            "implementation, e.g. torch's ShardedGradScaler over the model's process group)",
        )

    def state_dict(
        self, model: nn.Module, *, rank0_only: bool = False, offload_to_cpu: bool = False
    ) -> dict[str, Any]:
        """The full state dict, keyed like the unwrapped module's, on every rank (`rank0_only`:
        empty elsewhere; `offload_to_cpu`: on the CPU)."""
        if rank0_only or offload_to_cpu:
            unmapped(
                self,
                Feature.FULL_STATE_DICT,
                "override Adapter.state_dict (rank0_only: the full state dict on rank 0, empty "
                "elsewhere; offload_to_cpu: its tensors on the CPU)",
            )
        return model.state_dict()

    def load_state_dict(
        self, model: nn.Module, state_dict: dict[str, Any], *, assign: bool = False
    ) -> None:
        """Load a full state dict; `assign` as ``nn.Module.load_state_dict``'s."""
        if assign:
            unmapped(
                self,
                Feature.FULL_STATE_DICT,
                "override Adapter.load_state_dict (assign=True: load_state_dict's assign)",
            )
        model.load_state_dict(state_dict)

    def materialize(self, model: nn.Module, *, device: torch.device) -> None:
        """Materialise a meta-device model on `device` after wrapping (each module's
        ``reset_parameters()`` run once)."""
        unmapped(
            self,
            Feature.META_INIT,
            "override Adapter.materialize (after wrapping a meta-device model: every parameter "
            "and buffer on `device`, each module's reset_parameters() run once)",
        )

    def grad_shards(self, model: nn.Module) -> dict[str, tuple[int, torch.Tensor]] | None:
        """This rank's gradient pieces by unwrapped name, each ``(start, values)`` of the
        flattened averaged full gradient; None: not said."""
        return None

    def register_forward_method(self, instance: nn.Module, name: str) -> None:
        """Make ``instance.<name>(...)`` run as forward does (unsharded, gradients reduced)."""
        unmapped(
            self,
            Feature.FORWARD_METHOD,
            "override Adapter.register_forward_method (make instance.<name>() run the wrapped "
            "module's method with the instance's parameters unsharded, as forward does)",
        )

    def full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Detached copies of the full parameters by unwrapped name (tied: under each name)."""
        segments = declared(self).wrapper_segments
        with self.summon_full_params(model):  # type: ignore[attr-defined]
            return {
                clean_param_name(name, segments): param.detach().clone()
                for name, param in model.named_parameters(remove_duplicate=False)
            }

    def is_unsharded(self, instance: nn.Module) -> bool | None:
        """Whether `instance`'s unsharded parameters are allocated; None: not said."""
        return None

    def on_test_end(self) -> None:
        """After every harness test, before its process groups are destroyed: drop caches."""


HOOKS = frozenset(name for name in vars(EngineHooks) if not name.startswith("_")) - {"name"}


def _hook(adapter: Any, name: str) -> Callable[..., Any]:
    method = own_member(adapter, name) or stand_in(adapter, name)
    return method if method is not None else getattr(EngineHooks, name).__get__(adapter)


def overrides(adapter: Any, name: str) -> bool:
    """Whether `adapter` defines hook `name` itself (not `EngineHooks`' plain behaviour)."""
    method = own_member(adapter, name)
    return method is not None and getattr(method, "__func__", None) is not vars(EngineHooks).get(
        name
    )


def _calling(name: str) -> Callable[..., Any]:
    def call(adapter: Any, *args: Any, **kwargs: Any) -> Any:
        return _hook(adapter, name)(*args, **kwargs)

    # the hook's docstring and signature (its `self` is the adapter)
    functools.update_wrapper(call, getattr(EngineHooks, name))
    call.__qualname__ = name
    return call


# each: the adapter's own hook of that name, else the plain behaviour
optimizer = _calling("optimizer")
backward = _calling("backward")
accumulation_boundary = _calling("accumulation_boundary")
no_sync = _calling("no_sync")
clip_grad_norm_ = _calling("clip_grad_norm_")
grad_scaler = _calling("grad_scaler")
state_dict = _calling("state_dict")
load_state_dict = _calling("load_state_dict")
materialize = _calling("materialize")
grad_shards = _calling("grad_shards")
register_forward_method = _calling("register_forward_method")
full_params = _calling("full_params")
is_unsharded = _calling("is_unsharded")
on_test_end = _calling("on_test_end")


def group_size(adapter: Any, instance: nn.Module) -> int:
    """How many ranks `instance`'s gradients are combined over (its group, recorded by
    `Adapter.wrap`; else the default group's)."""
    method = own_member(adapter, "group_size") or stand_in(adapter, "group_size")
    if method is not None:
        return method(instance)
    sizes = adapter.__dict__.get("_group_sizes", {})
    return sizes[instance] if instance in sizes else _group_size(None)


def assert_state(adapter: Any, instance: nn.Module, *states: RootState) -> None:
    """The implementation's own state assertion, `_assert_state`."""
    if method := stand_in(adapter, "assert_state"):
        return method(instance, *states)
    require(adapter, Feature.ASSERT_STATE)
    _primitive(adapter, "_assert_state", Feature.ASSERT_STATE)(instance, states)
