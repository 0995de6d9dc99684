"""An eager FSDP of another shape, and its adapter (repository tests only; not shipped).

The shape of torchtitan's SimpleFSDP, written here from its description: no wrapper object --
``simple_fsdp(module)`` replaces each parameter of `module` (outside modules wrapped before) by a
DTensor shard (``Shard(0)`` over the group's mesh) and registers a ``torch.nn.utils.parametrize``
parametrization that all-gathers the shard on *every access* (``redistribute`` to
``Replicate``, in ``param_dtype``) and hands the local full tensor on with ``Partial`` gradient
placements, so backward reduce-scatters each parameter's gradient -- **summed** over the group
(``reduce_dtype``). Hybrid sharding: a (shard, replicate) pair of groups makes a 2-D mesh,
parameters ``(Replicate(), Shard(0))``: gathered within the shard group, gradients
reduce-scattered there and all-reduced across the replicas. All its collectives are functional
collectives (DTensor's), which the suite sees at torch's dispatcher. Resharding after forward
(FULL_SHARD): a ``saved_tensors_hooks`` pair around each instance's forward swaps every gathered
tensor autograd saves for a recipe, and backward all-gathers it again. Instances have no
training state and no ``summon_full_params``.

The adapter is written from docs/adapters.md ("FSDPs of other shapes"). ``PerClassCache``,
``KeepsGathered`` and ``ReducesInParamDtype`` are broken variants: the first caches its
mixed-precision policy per module class (a second model wrapped with another policy silently
gets the first one's); the second keeps every gathered parameter alive until backward; the third
reduces gradients in ``param_dtype``, ignoring ``reduce_dtype``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.nn.utils import parametrize

from fsdp_conformance.adapters import Adapter, Declarations, Deviation, Envelope, Feature, _dcp
from fsdp_conformance.adapters.base import ObserverRegistry
from fsdp_conformance.adapters.features import (
    ALL_FEATURES,
    MixedPrecisionConfig,
    auto_wrap_targets,
)

_REGISTRY = ObserverRegistry()  # its operations happen inside autograd: emitted, not patched
# storage pointer -> (gathered tensor, (parametrization, shard)), held while its instance's
# forward runs (the pointer cannot be reused meanwhile), dropped at its post-forward
_gathered: dict[int, tuple[torch.Tensor, Any]] = {}
_policy_by_class: dict[type, torch.dtype | None] = {}  # the broken per-class cache


def _emit(op: str, instance: Any) -> None:
    if _REGISTRY.active:  # unobserved training computes no event
        _REGISTRY.emit(op, instance(), {})


class _ReduceEvent(torch.autograd.Function):
    """Identity whose backward reports the reduce-scatter that follows it."""

    @staticmethod
    def forward(ctx: Any, full: torch.Tensor, gather: ReplicateOnAccess) -> torch.Tensor:
        ctx.gather = gather
        return full.view_as(full)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _emit("reduce_scatter", ctx.gather.instance)
        return grad, None


class ReplicateOnAccess(nn.Module):
    """The parametrization: the full parameter, gathered from its shard on each access."""

    def __init__(self, instance: nn.Module, param_dtype: Any, reduce_dtype: Any) -> None:
        super().__init__()
        self.instance = weakref.ref(instance)  # not a submodule: no cycle
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype

    def gather(self, shard: DTensor, grad: bool) -> torch.Tensor:
        _emit("all_gather", self.instance)
        dims = shard.device_mesh.ndim
        full = shard.redistribute(
            shard.device_mesh,
            [Replicate()] * dims,
            forward_dtype=self.param_dtype,
            backward_dtype=self.reduce_dtype,
        )
        return full.to_local(grad_placements=[Partial("sum")] * dims if grad else None)

    def forward(self, shard: DTensor) -> torch.Tensor:
        full = self.gather(shard, grad=True)
        if self.instance()._reshard_after_forward:  # saved for backward as a recipe
            _gathered[full.untyped_storage().data_ptr()] = (full, (self, shard))
        return _ReduceEvent.apply(full, self)


def _pack(tensor: torch.Tensor) -> Any:
    if type(tensor) is not torch.Tensor:
        return tensor
    entry = _gathered.get(tensor.untyped_storage().data_ptr())
    if entry is None:
        return tensor
    return (entry[1], tensor.size(), tensor.stride(), tensor.storage_offset())


def _unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed
    (gather, shard), size, stride, offset = packed
    with torch.no_grad():
        return gather.gather(shard, grad=False).as_strided(size, stride, offset)


def simple_fsdp(
    module: nn.Module,
    group: Any = None,
    *,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    output_dtype: torch.dtype | None = None,
    cast_forward_inputs: bool = True,
    cache_per_class: bool = False,
) -> nn.Module:
    """Shard `module`'s parameters (those outside instances wrapped before) in place over
    `group`, or a (shard, replicate) pair of groups (hybrid)."""
    if getattr(module, "_reshard_after_forward", None) is not None:
        raise ValueError(f"simple_fsdp: {type(module).__name__} is already wrapped")
    if cache_per_class:
        param_dtype = _policy_by_class.setdefault(type(module), param_dtype)
    group = group if group is not None else dist.group.WORLD
    module._reshard_after_forward = reshard_after_forward
    module._process_group = group
    module._param_dtype = param_dtype if cast_forward_inputs else None
    module._output_dtype = output_dtype
    mesh = None
    stack = [module]
    while stack:
        owner = stack.pop()
        stack.extend(c for c in owner.children() if not hasattr(c, "_reshard_after_forward"))
        for name, param in list(owner._parameters.items()):
            if param is None or parametrize.is_parametrized(owner, name):
                continue
            mesh = mesh or _mesh(group, param.device.type)
            placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
            shard = distribute_tensor(param.detach(), mesh, placements)
            del owner._parameters[name]
            owner.register_parameter(name, nn.Parameter(shard, param.requires_grad))
            gather = ReplicateOnAccess(module, param_dtype, reduce_dtype)
            parametrize.register_parametrization(owner, name, gather, unsafe=True)
    module.register_forward_pre_hook(_pre_forward, with_kwargs=True)
    module.register_forward_hook(_post_forward)
    return module


def _mesh(group: Any, device_type: str) -> DeviceMesh:
    """`group`'s mesh; for a (shard, replicate) pair the 2-D (replicate, shard) mesh, row i the
    i-th replica's shard group (dimension names carry the shard group's name: torch keeps mesh
    state per mesh value, and an equal mesh of an earlier test named groups destroyed since)."""
    if not isinstance(group, tuple):
        return DeviceMesh.from_group(group, device_type)
    shard, replicate = group
    rows: list[Any] = [None] * replicate.size()
    dist.all_gather_object(rows, dist.get_process_group_ranks(shard), group=replicate)
    names = (f"replicate{shard.group_name}", f"shard{shard.group_name}")
    return DeviceMesh.from_group(
        [replicate, shard], device_type, mesh=torch.tensor(rows), mesh_dim_names=names
    )


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(item, dtype) for item in value)
    return value


def _pre_forward(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if module._reshard_after_forward:
        hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        hooks.__enter__()
        module.__dict__.setdefault("_saved_hooks", []).append(hooks)
    dtype = module._param_dtype
    if dtype is None:
        return args, kwargs
    return _cast(args, dtype), {k: _cast(v, dtype) for k, v in kwargs.items()}


def _post_forward(module: nn.Module, args: Any, output: Any) -> Any:
    if module._reshard_after_forward:
        module._saved_hooks.pop().__exit__(None, None, None)
        for pointer, (_, (gather, _)) in list(_gathered.items()):
            if gather.instance() is module:
                del _gathered[pointer]
    return output if module._output_dtype is None else _cast(output, module._output_dtype)


# ---------------------------------------------------------------------------- the adapter
MEASURED_ON = "torch 2.13.0 (CPU, gloo), this eager implementation"
_SUPPORTED = {
    Feature.FULL_SHARD,
    Feature.SHARD_GRAD_OP,
    Feature.BACKWARD_PREFETCH_NONE,
    Feature.MIXED_PRECISION,
    Feature.MIXED_PRECISION_POLICY,
    Feature.HYBRID_SHARD,
    Feature.AUTO_WRAP_POLICY,
    Feature.COMM_TRACE,
    Feature.FROZEN_PARAMETERS,
    Feature.FROZEN_PARAMETERS_MIXED,
    Feature.FORWARD_VARIANTS,
    Feature.CHECKPOINT_RESUME,
}


_REASON = "simple_fsdp (tests/suite/simple_fsdp.py) has no such option"


class SimpleFSDPAdapter(Adapter):
    """Drives ``simple_fsdp``: an instance is the module a ``wrap`` call sharded (the module
    itself, parametrized in place); ``root_state`` / ``training_state`` do not exist."""

    name = "simple-fsdp"
    cache_per_class = False  # PerClassCache
    reshards = True  # KeepsGathered: False although FULL_SHARD is asked for
    reduces_in_reduce_dtype = True  # ReducesInParamDtype: False
    declarations = Declarations(
        unsupported={
            **{feature: _REASON for feature in ALL_FEATURES - _SUPPORTED},
            Feature.TRAINING_STATES: "an instance is a parametrized module: no training state",
            Feature.SUMMON_FULL_PARAMS: "no summon_full_params: each access all-gathers",
            Feature.GRADIENT_ACCUMULATION: "gradients are reduce-scattered inside autograd",
        },
        known_deviations=(
            Deviation(
                "parity.ddp",
                "a parameter shared by two modules (the transformer's tied embedding and output "
                "weight) is sharded once per module: two shards, trained apart (losses off by "
                "0.11 from step 1); reproduction: tests/suite/test_shapes.py, "
                "test_simple_fsdp_unties_tied_weights",
                lambda case: case.model == "transformer",
                # the largest over world sizes 1, 2, 4 and the ranks (0.228 at world size 2)
                envelope=Envelope(
                    "training differs from DDP's",
                    rtol=0.1,
                    loss_gap=0.228,
                    param_gap=0.096,
                    parameter="embed_tokens.weight",
                ),
                measured_on=MEASURED_ON,
            ),
        ),
        grad_reduction="sum",
        instance_states=False,
    )

    def _wrap(self, module: nn.Module, process_group: Any, config: dict[str, Any]) -> nn.Module:
        policy = config.get("auto_wrap_policy")
        child_config = {k: v for k, v in config.items() if k != "auto_wrap_policy"}
        if policy is not None:
            for _, child in auto_wrap_targets(module, policy):
                self.wrap(child, process_group=process_group, root=False, **child_config)
        mixed = config.get("mixed_precision") or MixedPrecisionConfig()
        keeps = config.get("sharding_strategy") in ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2")
        return simple_fsdp(
            module,
            process_group,
            reshard_after_forward=not keeps and self.reshards,
            param_dtype=mixed.param_dtype,
            reduce_dtype=mixed.reduce_dtype if self.reduces_in_reduce_dtype else mixed.param_dtype,
            output_dtype=mixed.output_dtype,
            cast_forward_inputs=mixed.cast_forward_inputs is not False,
            cache_per_class=self.cache_per_class,
        )

    def instances(self, model: nn.Module) -> list[nn.Module]:
        return [m for m in model.modules() if hasattr(m, "_reshard_after_forward")]

    def full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        full = {}
        for prefix, module in model.named_modules(remove_duplicate=False):
            dot = f"{prefix}." if prefix else ""
            for name, param in module._parameters.items():
                if param is not None:
                    full[dot + name] = param.detach().clone()
            if parametrize.is_parametrized(module):
                for name, entry in module.parametrizations.items():
                    full[dot + name] = entry.original.detach().full_tensor().clone()
        return {k: v for k, v in full.items() if ".parametrizations." not in f".{k}"}

    def _observe(self, callback: Any, instances: Any):
        return _REGISTRY.observing(callback, instances)

    def save_checkpoint(self, model: nn.Module, optimizer: Any, directory: str) -> None:
        _dcp.save(model, optimizer, directory, self._group(model))

    def load_checkpoint(self, model: nn.Module, optimizer: Any, directory: str) -> None:
        _dcp.load(model, optimizer, directory, self._group(model))

    def _group(self, model: nn.Module) -> Any:
        return model._process_group

    def on_test_end(self) -> None:
        _policy_by_class.clear()  # what a wrap reads outlives no test (docs/adapters.md)


class PerClassCache(SimpleFSDPAdapter):
    """Broken: the mixed-precision policy is cached per module class."""

    name = "simple-fsdp-per-class-cache"
    cache_per_class = True


class KeepsGathered(SimpleFSDPAdapter):
    """Broken: FULL_SHARD keeps every gathered parameter alive until backward."""

    name = "simple-fsdp-keeps-gathered"
    reshards = False


class ReducesInParamDtype(SimpleFSDPAdapter):
    """Broken: gradients are reduced in param_dtype, whatever reduce_dtype says."""

    name = "simple-fsdp-reduces-in-param-dtype"
    reduces_in_reduce_dtype = False


ADAPTER = SimpleFSDPAdapter()
