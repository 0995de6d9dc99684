"""Adapter for torch FSDP2: `torch.distributed.fsdp.fully_shard` on a DeviceMesh.

The FSDP1 vocabulary in FSDP2's terms (docs/adapters.md, "torch-fsdp2"): FULL_SHARD ->
`reshard_after_forward=None` (the root keeps its parameters, as FSDP1's FULL_SHARD),
SHARD_GRAD_OP -> False, NO_SHARD -> HSDP with a one-rank shard dimension; prefetch -> explicit
lists (`_fsdp2_prefetch.py`); the device handle per model (`_fsdp2_device.py`); summon ->
`unshard()` / `reshard()` (no writeback); auto_wrap_policy emulated, inner first.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp  # the FSDP2 namespace of Declarations.api
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_conformance.constants import Op
from fsdp_conformance.device_handle import accelerator_available
from fsdp_conformance.training_states import InstanceState, RootState

from . import _dcp
from . import _fsdp2_internals as internals
from ._fsdp2_device import INSTANCE_OF_GROUP, install_lagging_device, observe_buffers
from ._fsdp2_prefetch import configure_prefetch
from ._support import FSDP2_TORCH_RANGE
from .base import Adapter, ObserverRegistry, OpEvents, UnsupportedFeatureError
from .deviations import Deviation, Envelope
from .features import Declarations, Feature, auto_wrap_targets, ignored_parameters, require

# process-wide: observers of the patched FSDP2 internals
_REGISTRY = ObserverRegistry(
    "fsdp-conformance torch-fsdp2 comm trace", "torch " + "/".join(internals.VERIFIED_ON)
)


def _fsdp2_api() -> Any:
    import torch.distributed.fsdp as api

    internals.require(api, "fully_shard", "FSDPModule", "CPUOffloadPolicy", "MixedPrecisionPolicy")
    return api


# FSDP2's TrainingState names that differ from the canonical instance states
_RENAMED_STATES = {"PRE_BACKWARD": "BACKWARD_PRE", "POST_BACKWARD": "BACKWARD_POST"}


def _patch_torch_fsdp2() -> None:
    """Label `FSDPParamGroup`'s all-gathers (`unshard` without a pending result), frees
    (`reshard`, unless kept after forward) and reductions (`post_backward`) with their module;
    once per process, pass-through while nobody observes."""
    group_class = internals.param_group_class()
    forward = internals.training_state_enum().FORWARD

    def unshard(group: Any, *_: Any, **__: Any) -> OpEvents:
        if internals.all_gather_result(group) is None and not group.is_unsharded:
            yield Op.ALL_GATHER, INSTANCE_OF_GROUP.get(group)

    def reshard(group: Any) -> OpEvents:
        after_forward = internals.training_state(group) == forward
        kept = after_forward and not internals.reshards_after_forward(group)  # not freed
        if group.is_unsharded and not kept:
            yield Op.FREE, INSTANCE_OF_GROUP.get(group)

    def post_backward(group: Any, *_: Any, **__: Any) -> OpEvents:
        # only with gradient sync on and some gradient to reduce (not a frozen group)
        reduces = getattr(group, "reduce_grads", True) and internals.has_grads_to_reduce(group)
        if group.is_unsharded and reduces:
            yield Op.REDUCE_SCATTER, INSTANCE_OF_GROUP.get(group)

    _REGISTRY.patch_before(group_class, "unshard", unshard)
    _REGISTRY.patch_before(group_class, "reshard", reshard)
    _REGISTRY.patch_before(group_class, "post_backward", post_backward)


# measured on CPU, gloo, world size 2 (docs/checks.md)
_on_matrix = functools.partial(Deviation, measured_on="torch 2.13.0 (also 2.14.1, 2.15.0)")
FSDP2_DEVIATIONS = (
    _on_matrix(
        "exec_order.divergent",
        "torch FSDP2 does not compare the execution order across ranks; same-shaped instances "
        "silently exchange each other's all-gathers. Reproduction: fully_shard two Linear(8, 8) "
        "branches and the root, rank 1 runs the branches in the other order: no error",
        envelope=Envelope("no error raised"),
    ),
    _on_matrix(
        "misuse.mixed_devices",
        "torch FSDP2 fully_shard accepts a module with cpu and meta parameters without an error. "
        "Reproduction: fully_shard(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8, device='meta'))) "
        "-> no error",
        envelope=Envelope("no error raised"),
    ),
    _on_matrix(
        "misuse.forward_inside_summon",
        "torch FSDP2 has no summon_full_params; the torch-fsdp2 adapter emulates it with "
        "unshard()/reshard(), which do not refuse a forward. Reproduction: model.unshard(); "
        "model(x) -> no error",
        envelope=Envelope("no error raised"),
    ),
    _on_matrix(
        "misuse.summon_during_forward",
        "torch FSDP2 has no summon_full_params; the torch-fsdp2 adapter emulates it with "
        "unshard()/reshard(), which may be called inside forward. Reproduction: a forward hook "
        "calling root.unshard(); root.reshard() -> no error",
        envelope=Envelope("no error raised"),
    ),
    Deviation(
        "loops.clipping",
        "torch.nn.utils.clip_grad_norm_ over FSDP2 parameters on two device meshes (a NO_SHARD "
        "block is HSDP on its own 2-D mesh next to 1-D sharded blocks) fails: it stacks the "
        "per-tensor norms of both meshes. Reproduction (2 ranks): fully_shard one Linear on a "
        "(replicate=2, shard=1) mesh and the root on the 1-D mesh, backward, "
        "clip_grad_norm_(root.parameters(), 1.0) -> RuntimeError 'All operands in "
        "aten.stack.default must have the same mesh' (tests/adapters/test_measured_torch_facts.py)",
        lambda case: case.model == "loops_gains_no_shard",
        # DTensor's sharding propagation raises the RuntimeError from a ValueError
        raises=(RuntimeError, ValueError),
        match=r"must have the same mesh",
        measured_on="torch 2.13.0",
    ),
)


class TorchFSDP2Adapter(Adapter):
    """torch FSDP2 (`fully_shard`) on a mesh built from the process group."""

    name = "torch-fsdp2"
    declarations = Declarations(
        unsupported={
            Feature.LIMIT_ALL_GATHERS_OFF: (
                "torch FSDP2's memory bound is built in (stream-ordered reuse, reshard after "
                "forward): limit_all_gathers=False is a no-op, the bound cannot be switched off"
            ),
            Feature.MIXED_PRECISION_BUFFER_DTYPE: (
                "torch FSDP2 MixedPrecisionPolicy does not cast buffers"
            ),
            Feature.SYNC_MODULE_STATES: (
                "torch FSDP2 has no sync_module_states (broadcast a rank-0 state dict instead)"
            ),
            Feature.SUMMON_FULL_PARAMS_WRITEBACK: (
                "torch FSDP2 has no summon_full_params; the adapter emulates it with "
                "unshard()/reshard(), which does not copy changes back to the shards"
            ),
            Feature.ASSERT_STATE: "torch FSDP2 exposes no state assertion",
            Feature.USE_ORIG_PARAMS: (
                "torch FSDP2 always registers the original parameters (as DTensors)"
            ),
        },
        known_deviations=FSDP2_DEVIATIONS,
        support=(FSDP2_TORCH_RANGE,),
        api={"fsdp2": torch.distributed.fsdp},
    )

    def __init__(self) -> None:
        # instances inside the emulated summon_full_params
        self._summoned: weakref.WeakSet = weakref.WeakSet()

    def _wrap(self, module: nn.Module, process_group: Any, config: dict[str, Any]) -> nn.Module:
        hybrid = isinstance(process_group, tuple)  # (shard, replicate): a HYBRID_* strategy
        group = process_group[0] if hybrid else process_group
        group = group if group is not None else dist.group.WORLD
        device_id = config.get("device_id")
        if device_id is None:
            device_id = "cuda" if accelerator_available() else "cpu"  # (gloo on a GPU too)
        device_type = "cuda" if isinstance(device_id, int) else torch.device(device_id).type
        api = _fsdp2_api()
        if hybrid:
            mesh = _hybrid_mesh(*process_group, device_type)
        elif config.get("sharding_strategy") == "NO_SHARD" and group.size() > 1:
            mesh = _replicate_mesh(group, device_type)
        else:
            # named after the group: see _hybrid_mesh
            names = (f"shard{group.group_name}",)
            mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=names)
        kwargs: dict[str, Any] = {"mesh": mesh}
        if "sharding_strategy" in config:
            # None: FSDP2's auto (the root is kept unsharded); NO_SHARD has nothing to reshard
            full_shard = config["sharding_strategy"] in ("FULL_SHARD", "HYBRID_SHARD")
            kwargs["reshard_after_forward"] = None if full_shard else False
        if config.get("cpu_offload"):
            kwargs["offload_policy"] = api.CPUOffloadPolicy(pin_memory=accelerator_available())
        mixed = config.get("mixed_precision")
        if mixed is not None:
            kwargs["mp_policy"] = api.MixedPrecisionPolicy(
                param_dtype=mixed.param_dtype,
                reduce_dtype=mixed.reduce_dtype,
                output_dtype=mixed.output_dtype,
                cast_forward_inputs=mixed.cast_forward_inputs is not False,
            )
        if config.get("ignored_params"):
            kwargs["ignored_params"] = set(ignored_parameters(config))
        policy = config.get("auto_wrap_policy")
        if policy is not None:
            for _, submodule in auto_wrap_targets(module, policy, wrapped=(api.FSDPModule,)):
                self._register(api.fully_shard(submodule, **kwargs), config)
        return self._register(api.fully_shard(module, **kwargs), config)

    @staticmethod
    def _register(module: nn.Module, config: dict[str, Any]) -> nn.Module:
        for param_group in internals.module_param_groups(module):
            INSTANCE_OF_GROUP[param_group] = module
        configure_prefetch(module, config)
        return module

    def instances(self, model: nn.Module) -> list[nn.Module]:
        fsdp_module = _fsdp2_api().FSDPModule
        return [module for module in model.modules() if isinstance(module, fsdp_module)]

    def training_state(self, instance: nn.Module) -> InstanceState:
        if instance in self._summoned:
            return InstanceState.SUMMON_FULL_PARAMS
        state = internals.fsdp_state(instance)
        groups = internals.param_groups(state)
        name = internals.training_state(groups[0] if groups else state).name
        return InstanceState[_RENAMED_STATES.get(name, name)]

    def root_state(self, instance: nn.Module) -> RootState:
        if instance in self._summoned:
            return RootState.SUMMON_FULL_PARAMS
        state = internals.fsdp_state(instance)
        if internals.training_state(state) == internals.training_state_enum().IDLE:
            return RootState.IDLE
        return RootState.FORWARD_BACKWARD

    def is_unsharded(self, instance: nn.Module) -> bool:
        groups = internals.module_param_groups(instance)
        return bool(groups) and all(group.is_unsharded for group in groups)

    @contextlib.contextmanager
    def _summon_full_params(self, model: nn.Module, writeback: bool) -> Iterator[None]:
        instances = self.instances(model)
        for instance in instances:
            instance.unshard()
            self._summoned.add(instance)
        try:
            yield
        finally:
            for instance in reversed(instances):
                self._summoned.discard(instance)
                instance.reshard()

    def full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.tensor import DTensor

        return {
            name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
            for name, param in model.named_parameters(remove_duplicate=False)
        }

    def _observe(self, callback, instances):
        if getattr(callback, "buffer_events", False):  # [Note: FSDP2 buffers]
            return observe_buffers(callback, instances)
        _patch_torch_fsdp2()
        return _REGISTRY.observing(callback, instances)

    def _install_device_handle(self, model: nn.Module, handle: Any) -> None:
        install_lagging_device(model, handle)

    def grad_scaler(self, model: nn.Module, **options: Any) -> Any:
        """``torch.amp.GradScaler``: the inf/NaN check of DTensor gradients combines found_inf
        across the mesh (measured: one rank's inf skips the step on both)."""
        device = next(model.parameters()).device.type
        return torch.amp.GradScaler(device, **options)

    def on_test_end(self) -> None:
        _REPLICATE_MESHES.clear()  # their groups are destroyed after the test
        _HYBRID_MESHES.clear()

    def grad_shards(self, model: nn.Module) -> dict[str, tuple[int, torch.Tensor]]:
        """Each DTensor gradient's ``to_local()`` at its offset: dim 0 in ``torch.chunk``'s rows
        (ceil(rows / n) per mesh coordinate), replicated over an HSDP mesh's other dimension."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        pieces = {}
        for name, param in model.named_parameters():
            grad = param.grad
            if not isinstance(grad, DTensor) or grad.ndim == 0:
                continue
            start_row = 0
            coordinate = grad.device_mesh.get_coordinate()
            for mesh_dim, placement in enumerate(grad.placements):
                if isinstance(placement, Shard) and placement.dim == 0:
                    rows_per_rank = -(-grad.shape[0] // grad.device_mesh.size(mesh_dim))
                    start_row = coordinate[mesh_dim] * rows_per_rank
                elif not isinstance(placement, Replicate):
                    return None  # a layout this reading does not know: parity per step only
            local = grad.to_local().detach().reshape(-1)
            if local.numel():
                pieces[name] = (start_row * (grad.numel() // grad.shape[0]), local)
        return pieces

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        require(self, Feature.GRADIENT_ACCUMULATION)
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def clip_grad_norm_(
        self, model: nn.Module, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the DTensor gradients, as FSDP2 users call it;
        the DTensor norm made plain with ``full_tensor()``."""
        require(self, Feature.CLIP_GRAD_NORM)
        from torch.distributed.tensor import DTensor

        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def state_dict(
        self, model: nn.Module, *, rank0_only: bool = False, offload_to_cpu: bool = False
    ) -> dict[str, Any]:
        """``get_model_state_dict(full_state_dict=True)``; ``rank0_only`` is its ``cpu_offload``
        (rank 0 only, on the CPU)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if offload_to_cpu and not rank0_only:
            raise UnsupportedFeatureError(
                self.name,
                Feature.FULL_STATE_DICT,
                "offload_to_cpu without rank0_only: torch FSDP2's "
                "get_model_state_dict(full_state_dict=True, cpu_offload=True) gives the other "
                "ranks an empty dict",
            )
        options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
        return get_model_state_dict(model, options=options)

    def load_state_dict(
        self, model: nn.Module, state_dict: dict[str, Any], *, assign: bool = False
    ) -> None:
        """``set_model_state_dict(full_state_dict=True)``; ``assign``: each tensor laid out as
        its parameter's DTensor (``distribute_tensor``), then ``load_state_dict(assign=True)``."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.tensor import DTensor, distribute_tensor

        if not assign:
            options = StateDictOptions(full_state_dict=True)
            set_model_state_dict(model, state_dict, options=options)
            return
        current = model.state_dict()
        sharded = {}
        for key, value in state_dict.items():
            target = current.get(key)
            if isinstance(target, DTensor):
                value = distribute_tensor(
                    value.to(target.device), target.device_mesh, target.placements
                )
            sharded[key] = value
        model.load_state_dict(sharded, assign=True)

    def materialize(self, model: nn.Module, *, device: torch.device) -> None:
        """``model.to_empty(device=...)``, then each module's ``reset_parameters()``."""
        model.to_empty(device=device)
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()

    def register_forward_method(self, instance: nn.Module, name: str) -> None:
        require(self, Feature.FORWARD_METHOD)
        from torch.distributed.fsdp import register_fsdp_forward_method

        register_fsdp_forward_method(instance, name)

    def save_checkpoint(self, model: nn.Module, optimizer: Any, directory: str) -> None:
        require(self, Feature.CHECKPOINT_RESUME)
        _dcp.save(model, optimizer, directory, _model_group(model))

    def load_checkpoint(self, model: nn.Module, optimizer: Any, directory: str) -> None:
        require(self, Feature.CHECKPOINT_RESUME)
        _dcp.load(model, optimizer, directory, _model_group(model))


def _model_group(model: nn.Module) -> Any:
    """The process group of the root's mesh (HSDP: the replicate group)."""
    groups = internals.module_param_groups(model)
    mesh = groups[0].mesh_info.mesh if groups else None
    if mesh is None:
        from torch.distributed.tensor import DTensor

        mesh = next(p.device_mesh for p in model.parameters() if isinstance(p, DTensor))
    return mesh.get_group(0)


# NO_SHARD and HYBRID_* meshes of this test (on_test_end empties them)
_REPLICATE_MESHES: dict[tuple[Any, str], DeviceMesh] = {}
_HYBRID_MESHES: dict[tuple[Any, Any, str], DeviceMesh] = {}


def _mesh_2d(replicate: Any, shard: Any, ranks: list[int], device_type: str, names: Any) -> Any:
    """The (replicate, shard) mesh of two existing groups; `ranks` row by row."""
    return DeviceMesh.from_group(
        [replicate, shard],
        device_type,
        mesh=torch.tensor(ranks).view(replicate.size(), shard.size()),
        mesh_dim_names=names,
    )


def _replicate_mesh(group: Any, device_type: str) -> DeviceMesh:
    """NO_SHARD as HSDP with a one-rank shard dimension: whole parameters on every rank,
    gradients all-reduced over ``group``. This rank alone creates its one-rank group
    (``use_local_synchronization``)."""
    key = (group, device_type)
    if key not in _REPLICATE_MESHES:
        ranks = dist.get_process_group_ranks(group)
        alone = dist.new_group([dist.get_rank()], use_local_synchronization=True)
        _REPLICATE_MESHES[key] = _mesh_2d(group, alone, ranks, device_type, ("replicate", "shard"))
    return _REPLICATE_MESHES[key]


def _hybrid_mesh(shard: Any, replicate: Any, device_type: str) -> DeviceMesh:
    """HYBRID_SHARD's 2-D mesh: row i is the i-th shard group.

    The dimension names carry the shard group's name: torch keeps DeviceMesh state per mesh
    value, so an equal mesh of groups destroyed since (an earlier test in this process) made
    ``full_tensor()`` gather over those ("Could not resolve the process group registered under
    the name 1", torch 2.13.0).
    """
    key = (shard, replicate, device_type)
    if key not in _HYBRID_MESHES:
        columns = shard.size()
        ranks = [0] * (replicate.size() * columns)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (dist.get_rank(), replicate.rank(), shard.rank()))
        for rank, row, column in gathered:
            ranks[row * columns + column] = rank
        names = (f"replicate{shard.group_name}", f"shard{shard.group_name}")
        _HYBRID_MESHES[key] = _mesh_2d(replicate, shard, ranks, device_type, names)
    return _HYBRID_MESHES[key]
