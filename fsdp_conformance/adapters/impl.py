"""Adapter for our reference FSDP (`fsdp_conformance.impl`): it exposes everything the suite
observes (states, `is_unsharded`, a device handle, `impl.trace`), so nothing is patched."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from fsdp_conformance import impl
from fsdp_conformance.impl import checkpoint, optim
from fsdp_conformance.training_states import InstanceState, RootState

from ._support import TORCH_RANGE
from .base import (
    Adapter,
    UnsupportedFeatureError,
    clean_param_name,
    optimizer_class,
    scoped_observer,
)
from .features import Declarations, Feature, fsdp1_style_kwargs, ignored_parameters, require


class ImplAdapter(Adapter):
    """The reference FSDP of this project."""

    name = "impl"
    declarations = Declarations(
        unsupported={
            Feature.USE_ORIG_PARAMS: (
                "impl's optimizer always sees flat parameters; frozen and trainable parameters "
                "mix in one instance without a flag (the frozen ones stay unflattened)"
            ),
            Feature.HYBRID_SHARD: (
                "impl shards each flat parameter over one process group; it has no replicate "
                "group to all-reduce across (HYBRID_SHARD)"
            ),
        },
        support=(TORCH_RANGE,),
    )

    def _wrap(self, module: nn.Module, process_group: Any, config: dict[str, Any]) -> nn.Module:
        kwargs = fsdp1_style_kwargs(config, impl)
        if "device_id" in config:
            kwargs["device_id"] = config["device_id"]
        if config.get("ignored_params"):
            kwargs["ignored_modules"] = self._ignored_modules(module, config)
        return impl.FullyShardedDataParallel(module, process_group=process_group, **kwargs)

    def _ignored_modules(self, module: nn.Module, config: dict[str, Any]) -> list[nn.Module]:
        """``ignored_params`` as impl's ``ignored_modules``: the largest submodules all of whose
        parameters are ignored (impl ignores whole modules only)."""
        ignored = {id(param) for param in ignored_parameters(config)}
        modules: list[nn.Module] = []
        covered: set[int] = set()
        for submodule in module.modules():
            params = {id(param) for param in submodule.parameters()}
            if params and params <= ignored and not params <= covered:
                modules.append(submodule)
                covered |= params
        if covered != ignored:
            raise UnsupportedFeatureError(
                self.name,
                Feature.IGNORED_PARAMS,
                "impl ignores whole modules (ignored_modules); give parameters that make up "
                "whole submodules of the wrapped module",
            )
        return modules

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, impl.FullyShardedDataParallel) else model

    def instances(self, model: nn.Module) -> list[nn.Module]:
        return list(impl.FullyShardedDataParallel.fsdp_modules(model))

    def training_state(self, instance: nn.Module) -> InstanceState:
        return InstanceState[instance.handle_training_state.name]

    def root_state(self, instance: nn.Module) -> RootState:
        return RootState[instance.training_state.name]

    def is_unsharded(self, instance: nn.Module) -> bool:
        return bool(instance.is_unsharded)

    def full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        # impl's original parameters are plain attributes, not registered: read its state dict
        buffers = {clean_param_name(name) for name, _ in model.named_buffers()}
        return {
            name: value
            for name, value in model.state_dict().items()
            if clean_param_name(name) not in buffers
        }

    def _assert_state(self, instance: nn.Module, states: tuple[RootState, ...]) -> None:
        instance._assert_state([impl.TrainingState[state.value] for state in states])

    def _summon_full_params(self, model: nn.Module, writeback: bool):
        return model.summon_full_params(writeback=writeback)

    @contextlib.contextmanager
    def _observe(self, callback, instances):
        with scoped_observer(callback, instances) as observer, impl.trace.observe(observer):
            yield

    def _install_device_handle(self, model: nn.Module, handle: Any) -> None:
        impl.device.install_device_handle(model, handle)

    def grad_scaler(self, model: nn.Module, **options: Any) -> Any:
        """torch's ``ShardedGradScaler`` over the root's group (plain sharded gradients)."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        device = next(model.parameters()).device.type
        return ShardedGradScaler(device, process_group=model.process_group, **options)

    def grad_shards(self, model: nn.Module) -> dict[str, tuple[int, torch.Tensor]]:
        """Each original parameter's piece of its flat gradient shard (``impl/optim.py``)."""
        pieces = {}
        for name, _, source in optim.shard_pieces(model):
            if source is not None and source[0].grad is not None:
                flat, start, end, start_in_param = source
                pieces[clean_param_name(name)] = (start_in_param, flat.grad.detach()[start:end])
        return pieces

    def state_dict(
        self, model: nn.Module, *, rank0_only: bool = False, offload_to_cpu: bool = False
    ) -> dict[str, Any]:
        return model.state_dict(rank0_only=rank0_only, offload_to_cpu=offload_to_cpu)

    def load_state_dict(
        self, model: nn.Module, state_dict: dict[str, Any], *, assign: bool = False
    ) -> None:
        model.load_state_dict(state_dict, assign=assign)

    def materialize(self, model: nn.Module, *, device: torch.device) -> None:
        """Nothing: impl materialises meta-device modules when it wraps them."""

    def optimizer(
        self,
        model: nn.Module,
        name: str = "sgd",
        *,
        param_groups: Any = None,
        **hyperparameters: Any,
    ) -> torch.optim.Optimizer:
        """With `param_groups`: over the pieces of the original parameters in this rank's shard,
        grouped by name (``impl/optim.py``)."""
        if param_groups is None:
            return super().optimizer(model, name, **hyperparameters)
        require(self, Feature.PARAM_GROUPS)
        return optim.optimizer(model, optimizer_class(self, name), param_groups, **hyperparameters)

    def register_forward_method(self, instance: nn.Module, name: str) -> None:
        require(self, Feature.FORWARD_METHOD)
        instance.register_forward_method(name)

    def save_checkpoint(self, model: nn.Module, optimizer: Any, directory: str) -> None:
        checkpoint.save_checkpoint(model, optimizer, directory)

    def load_checkpoint(self, model: nn.Module, optimizer: Any, directory: str) -> None:
        checkpoint.load_checkpoint(model, optimizer, directory)
