"""``FullyShardedDataParallel``: construction and validation (argument checks, auto-wrap,
parameter collection, the compute device, ``sync_module_states``). Forward, ``no_sync`` and
summon are in ``forward.py``, state dicts in ``state_dict.py``, the hooks in ``runtime.py``;
everything an instance knows is in its ``FSDPState``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_conformance.device_handle import DeviceHandle, accelerator_available

from . import runtime
from .api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from .flat_param import FlatParamHandle
from .forward import ForwardMixin
from .state import FSDPState, assert_state, fsdp_states
from .state_dict import StateDictMixin

AutoWrapPolicy = Callable[..., bool]
Params = list[tuple[nn.Module, str, nn.Parameter]]  # (module, attribute name, parameter)


def _state_attribute(name: str, doc: str) -> property:
    return property(lambda self: getattr(self._fsdp_state, name), doc=doc)


_WRAPPED = "_fsdp_wrapped_module"


class FullyShardedDataParallel(ForwardMixin, StateDictMixin, nn.Module):
    """Shard ``module``'s parameters over ``process_group`` (flat-parameter FSDP, FSDP1 family).

    The parameters not inside a nested instance or an ignored module form one flat parameter;
    each rank keeps a shard. The outermost instance becomes the root at its first forward.

    Args:
        module: the module to wrap.
        process_group: default: the default group; a one-rank group behaves like NO_SHARD.
        sharding_strategy: FULL_SHARD, SHARD_GRAD_OP or NO_SHARD.
        cpu_offload: ``CPUOffload(offload_params=True)`` keeps shards and gradients on CPU.
        auto_wrap_policy: ``policy(module=, recurse=, nonwrapped_numel=) -> bool`` (torch's);
            matching submodules are wrapped inner-first with the same arguments.
        backward_prefetch: BACKWARD_PRE, BACKWARD_POST or None.
        mixed_precision: dtypes for compute/communication; master shards stay fp32.
        device_id: compute device (int: CUDA index); default: the parameters' device.
        sync_module_states: broadcast parameters and buffers from rank 0 (shapes checked).
        forward_prefetch: issue the next instance's all-gather in pre-forward (static graphs).
        limit_all_gathers: rate-limit all-gathers (``limiter.py``).
        ignored_modules: modules whose parameters and buffers FSDP leaves alone.
        param_init_fn: for a meta-device module, ``param_init_fn(submodule)`` allocates and
            initialises each managed submodule's own tensors on the compute device; default:
            ``to_empty(recurse=False)`` then ``reset_parameters()``.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: Any = None,
        sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: AutoWrapPolicy | None = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
    ) -> None:
        _check_arguments(module, sharding_strategy, cpu_offload, backward_prefetch, mixed_precision)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "FullyShardedDataParallel needs an initialized process group; call "
                "torch.distributed.init_process_group() before wrapping"
            )
        super().__init__()
        process_group = process_group if process_group is not None else dist.group.WORLD
        ignored = _expand_ignored(ignored_modules)
        for nested in fsdp_states(module):
            if nested.is_root is not None:
                raise ValueError(
                    f"cannot wrap {type(module).__name__}: its nested FSDP instance around "
                    f"{type(nested.module).__name__} already ran forward (it was lazily "
                    "initialized as a root); construct the outer FSDP instances before the first "
                    "forward of any inner one"
                )
        if auto_wrap_policy is not None:
            child_kwargs = {
                "process_group": process_group,
                "sharding_strategy": sharding_strategy,
                "cpu_offload": cpu_offload,
                "backward_prefetch": backward_prefetch,
                "mixed_precision": mixed_precision,
                "device_id": device_id,
                "sync_module_states": sync_module_states,
                "forward_prefetch": forward_prefetch,
                "limit_all_gathers": limit_all_gathers,
                "ignored_modules": ignored_modules,
                "param_init_fn": param_init_fn,
            }
            _recursive_wrap(module, auto_wrap_policy, ignored, child_kwargs, only_children=True)

        _materialize_meta(module, ignored, device_id, param_init_fn)
        params = _frozen_apart(module, _collect_params(module, ignored), mixed_precision)
        compute_device = _compute_device(module, params, device_id)
        cpu_offload = cpu_offload or CPUOffload()
        if compute_device.type != "cpu":
            _move_to_compute_device(module, ignored, compute_device, cpu_offload)
        if sync_module_states:
            _sync_module_states(module, params, process_group)
        self._fsdp_state = state = FSDPState(
            owner=self,
            module=module,
            process_group=process_group,
            sharding_strategy=sharding_strategy,
            cpu_offload=cpu_offload,
            backward_prefetch=backward_prefetch,
            mixed_precision=mixed_precision,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            compute_device=compute_device,
        )
        if params:
            _check_uniform(module, params)
            # a hook on a tensor that views share is invisible to the garbage collector, so
            # the state it reaches is held weakly: else a dropped model is never freed
            state_ref = weakref.ref(state)
            state.handle = FlatParamHandle(
                self,
                params,
                process_group,
                sharding_strategy,
                mixed_precision,
                cpu_offload.offload_params,
                compute_device,
                pin_memory=accelerator_available(),
                grad_hook=lambda unsharded: runtime.post_backward_hook(state_ref(), unsharded),
            )
            for _, _, param in params:
                param._fsdp_flattened = True
            self.register_parameter("_flat_param", state.handle.flat_param)
        module.__dict__["_fsdp_wrapped"] = True
        self._fsdp_wrapped_module = module

    module = _state_attribute("module", "The wrapped module.")
    process_group = _state_attribute("process_group", "The group this instance shards over.")
    sharding_strategy = _state_attribute("sharding_strategy", "The requested ShardingStrategy.")
    cpu_offload = _state_attribute("cpu_offload", "The CPUOffload configuration.")
    backward_prefetch = _state_attribute("backward_prefetch", "BackwardPrefetch or None.")
    mixed_precision = _state_attribute("mixed_precision", "MixedPrecision or None.")
    forward_prefetch = _state_attribute("forward_prefetch", "Prefetch the next one in forward.")
    limit_all_gathers = _state_attribute("limit_all_gathers", "Rate-limit the all-gathers.")
    compute_device = _state_attribute("compute_device", "The device computation runs on.")
    training_state = _state_attribute("training_state", "The instance's TrainingState.")
    handle_training_state = _state_attribute(
        "handle_training_state", "The flat parameter's HandleTrainingState."
    )
    is_root = _state_attribute("is_root", "None before lazy init, then whether this is the root.")

    @property
    def is_unsharded(self) -> bool:
        handle = self._fsdp_state.handle
        return handle is not None and handle.is_unsharded

    @property
    def flat_param(self) -> nn.Parameter | None:
        """This rank's shard of the flat parameter (None if the instance has no parameters)."""
        handle = self._fsdp_state.handle
        return handle.flat_param if handle is not None else None

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == _WRAPPED:
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def _use_device_handle(self, handle: DeviceHandle) -> None:
        """``UsesDeviceHandle``: route streams and events through ``handle``."""
        state = self._fsdp_state
        state.device_handle = handle
        if state.context is not None and state.is_root:
            state.context.create_streams(handle)

    @staticmethod
    def fsdp_modules(module: nn.Module) -> list[FullyShardedDataParallel]:
        """FSDP instances in ``module``'s tree, pre-order."""
        return [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip all gradients under this root by their global norm (``impl/clip.py``)."""
        from fsdp_conformance.impl.clip import clip_grad_norm_

        return clip_grad_norm_(self, max_norm, norm_type)

    def _assert_state(self, state: Any) -> None:
        """AssertionError unless this instance is in ``state`` (a ``TrainingState`` or
        ``HandleTrainingState``, or a list of them)."""
        assert_state(self._fsdp_state, state)


def _check_arguments(module, sharding_strategy, cpu_offload, backward_prefetch, mixed_precision):
    if isinstance(module, FullyShardedDataParallel):
        raise ValueError(  # noqa: TRY004  (the type is right, the module is wrapped twice)
            f"module is already a FullyShardedDataParallel instance (around "
            f"{type(module.module).__name__}); wrap each module once"
        )
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"FullyShardedDataParallel expects an nn.Module, got {type(module).__name__}"
        )
    if module.__dict__.get("_fsdp_wrapped", False):
        raise ValueError(
            f"{type(module).__name__} is already wrapped by another FullyShardedDataParallel "
            "instance; wrap each module once"
        )
    if not isinstance(sharding_strategy, ShardingStrategy):
        raise TypeError(f"sharding_strategy must be a ShardingStrategy, got {sharding_strategy!r}")
    for name, value, kind in (
        ("cpu_offload", cpu_offload, CPUOffload),
        ("backward_prefetch", backward_prefetch, BackwardPrefetch),
        ("mixed_precision", mixed_precision, MixedPrecision),
    ):
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"{name} must be {kind.__name__} or None, got {value!r}")


def _expand_ignored(ignored_modules: Iterable[nn.Module] | None) -> set[nn.Module]:
    ignored: set[nn.Module] = set()
    for module in ignored_modules or ():
        if not isinstance(module, nn.Module):
            raise TypeError(f"ignored_modules must contain nn.Modules, got {type(module).__name__}")
        if isinstance(module, FullyShardedDataParallel):
            raise ValueError(  # noqa: TRY004  (an nn.Module, but one FSDP cannot ignore)
                "ignored_modules must not contain FullyShardedDataParallel instances"
            )
        ignored.update(module.modules())
    return ignored


def _recursive_wrap(
    module: nn.Module,
    policy: AutoWrapPolicy,
    ignored: set[nn.Module],
    kwargs: dict[str, Any],
    only_children: bool,
) -> tuple[nn.Module, int]:
    """torch's auto-wrap recursion: children first, then the module with what is left."""
    ignored_params = {id(p) for m in ignored for p in m.parameters(recurse=False)}
    nonwrapped = sum(p.numel() for p in module.parameters() if id(p) not in ignored_params)
    if not policy(module=module, recurse=True, nonwrapped_numel=nonwrapped):
        return module, 0
    wrapped_numel = 0
    for name, child in module.named_children():
        if child in ignored or isinstance(child, FullyShardedDataParallel):
            continue
        new_child, numel = _recursive_wrap(child, policy, ignored, kwargs, only_children=False)
        if new_child is not child:
            setattr(module, name, new_child)
        wrapped_numel += numel
    remainder = nonwrapped - wrapped_numel
    if not only_children and policy(module=module, recurse=False, nonwrapped_numel=remainder):
        return FullyShardedDataParallel(module, **kwargs), nonwrapped
    return module, wrapped_numel


def _managed_modules(module: nn.Module, ignored: set[nn.Module]) -> list[nn.Module]:
    """`module` and its submodules this instance manages (not in a nested instance or
    ignored), pre-order, each once."""
    if isinstance(module, FullyShardedDataParallel) or module in ignored:
        return []
    found = [module]
    for child in module.children():
        found += [m for m in _managed_modules(child, ignored) if m not in found]
    return found


def _collect_params(module: nn.Module, ignored: set[nn.Module]) -> Params:
    """Every parameter this instance manages, in order."""
    paths = {id(m): f"{path}." if path else "" for path, m in module.named_modules()}
    found: Params = []
    for m in _managed_modules(module, ignored):
        for name, param in m._parameters.items():
            if param is None:
                continue
            if getattr(param, "_fsdp_flattened", False):
                raise ValueError(
                    f"parameter '{paths[id(m)]}{name}' of {type(m).__name__} is shared with "
                    "another FSDP instance that already flattened it (a tied parameter); wrap all "
                    "modules sharing a parameter in the same instance (e.g. their common parent)"
                )
            found.append((m, name, param))
    return found


def _materialize_meta(
    module: nn.Module,
    ignored: set[nn.Module],
    device_id: int | torch.device | None,
    param_init_fn: Callable[[nn.Module], None] | None,
) -> None:
    """Materialise the managed submodules when all their tensors are on the meta device (meta
    mixed with other devices is left to ``_compute_device``'s error)."""
    if param_init_fn is not None and not callable(param_init_fn):
        raise TypeError(f"param_init_fn must be callable (module) -> None, got {param_init_fn!r}")
    owned = _managed_modules(module, ignored)
    tensors = [
        t for m in owned for t in (*m._parameters.values(), *m._buffers.values()) if t is not None
    ]
    if not tensors or not all(t.is_meta for t in tensors):
        return
    if device_id is not None:
        device = _device_of(device_id)
    elif accelerator_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    with torch.no_grad():
        for m in owned:
            if not any(t is not None for t in (*m._parameters.values(), *m._buffers.values())):
                continue
            if param_init_fn is not None:
                param_init_fn(m)
                continue
            reset = getattr(m, "reset_parameters", None)
            if not callable(reset):
                raise ValueError(
                    f"{type(m).__name__} was built on the meta device but has no "
                    "reset_parameters(); give it one (initialising its own parameters and "
                    "buffers) or pass param_init_fn"
                )
            m.to_empty(device=device, recurse=False)
            reset()


def _frozen_apart(module: nn.Module, params: Params, mp: MixedPrecision | None) -> Params:
    """The parameters to flatten: frozen ones next to trainable ones stay registered whole on
    every rank (no gradient, nothing to reduce), so a ``param_dtype`` that nothing would cast
    them to is refused; all frozen are flattened as usual."""
    trainable = [(m, name, param) for m, name, param in params if param.requires_grad]
    if not trainable or len(trainable) == len(params):
        return params
    dtype = None if mp is None else mp.param_dtype
    if dtype is not None and any(p.dtype != dtype for _, _, p in params if not p.requires_grad):
        raise ValueError(
            f"cannot wrap {type(module).__name__} with mixed_precision param_dtype={dtype}: it "
            "mixes frozen and trainable parameters, and the frozen ones stay apart in their own "
            "dtype; wrap the frozen submodules in their own FSDP instance (or freeze all or none "
            "of this instance's parameters)"
        )
    return trainable


def _compute_device(
    module: nn.Module, params: Params, device_id: int | torch.device | None
) -> torch.device:
    devices: dict[torch.device, str] = {}
    names = {id(m): n for n, m in module.named_modules()}
    for m, name, param in params:
        devices.setdefault(param.device, f"{names.get(id(m), '?')}.{name}".lstrip("."))
    if len(devices) > 1:
        listing = ", ".join(f"{d} (e.g. '{n}')" for d, n in devices.items())
        raise ValueError(
            f"{type(module).__name__} has parameters on mixed devices: {listing}; move the "
            "module to one device (module.to(device)) before wrapping it with FSDP"
        )
    if any(d.type == "meta" for d in devices):
        raise ValueError(
            f"{type(module).__name__} has parameters on the meta device; materialize them "
            "(module.to_empty(device=...) and initialize) before wrapping it with FSDP"
        )
    if device_id is not None:
        device = _device_of(device_id)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", 0)
        return device
    return next(iter(devices)) if devices else torch.device("cpu")


def _device_of(device_id: int | torch.device) -> torch.device:
    if isinstance(device_id, int):
        return torch.device("cuda", device_id)
    return torch.device(device_id)


def _move_to_compute_device(
    module: nn.Module, ignored: set[nn.Module], device: torch.device, offload: CPUOffload
) -> None:
    """Buffers go to ``device``; parameters too unless offloaded."""
    for submodule in module.modules():
        if submodule in ignored or isinstance(submodule, FullyShardedDataParallel):
            continue
        for name, buffer in submodule._buffers.items():
            if buffer is not None:
                submodule._buffers[name] = buffer.to(device)
        if not offload.offload_params:
            for param in submodule._parameters.values():
                if param is not None:
                    param.data = param.data.to(device)


def _check_uniform(module: nn.Module, params: Params) -> None:
    dtypes = {p.dtype for _, _, p in params}
    if len(dtypes) > 1:
        raise ValueError(
            f"FSDP flattens {type(module).__name__}'s parameters into one tensor but they have "
            f"dtypes {sorted(map(str, dtypes))}; cast them to one dtype or wrap them separately"
        )


def _sync_module_states(module: nn.Module, params: Params, group: Any) -> None:
    """Check shapes across ranks (one object all-gather), then broadcast from rank 0."""
    if group.size() == 1:
        return
    names = {id(m): n for n, m in module.named_modules()}
    unique: dict[int, tuple[str, torch.Tensor]] = {}
    for m, name, param in params:  # a tied parameter once, under its first name
        unique.setdefault(id(param), (f"{names[id(m)]}.{name}".lstrip("."), param.data))
    tensors = [*unique.values(), *module.named_buffers()]
    local = [(name, tuple(t.shape), str(t.dtype)) for name, t in tensors]
    gathered: list[Any] = [None] * group.size()
    dist.all_gather_object(gathered, local, group=group)
    reference = gathered[0]
    for rank, other in enumerate(gathered):
        if other == reference:
            continue
        detail = next(
            (
                f"'{a[0]}' is {a[1]} {a[2]} on rank 0 but {b[1]} {b[2]} on rank {rank}"
                for a, b in zip(reference, other)
                if a != b
            ),
            f"rank 0 has {len(reference)} tensors, rank {rank} has {len(other)}",
        )
        raise ValueError(
            f"sync_module_states=True: {type(module).__name__} differs across ranks: {detail}; "
            "build the same model on every rank before wrapping"
        )
    source = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for _, tensor in tensors:
            dist.broadcast(tensor, src=source, group=group)
