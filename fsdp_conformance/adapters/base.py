"""The adapter protocol: `Adapter`, the zoo's `AdapterWrap`, and observation helpers.

[Note: observation]
`observe(callback, instances=None)` calls `callback(op, instance, info)` *before* each operation
of an instance: "all_gather", "free", "reduce_scatter" / "all_reduce". `instances=None` observes
the events emitted on the calling thread, or on a thread that observes nothing itself
(autograd's device threads), so the threaded ranks of `thread` mode do not see each other's.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import re
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from fsdp_conformance import constants
from fsdp_conformance._patching import patch_attribute
from fsdp_conformance.constants import Op
from fsdp_conformance.training_states import InstanceState, RootState

from . import features
from ._removed import refuse_removed_names
from .features import (  # the errors and claimed_but_not_implemented: also imported from here
    Declarations,
    Feature,
    FeatureNotImplementedError,
    UnsupportedFeatureError,
    check_process_group,
    claimed_but_not_implemented,  # noqa: F401
    normalize_config,
)

# callback(op, instance, info): [Note: observation]
Observer = Callable[[str, nn.Module, dict], None]
# what an `ObserverRegistry.before` event yields: (op, instance) pairs
OpEvents = Iterable[tuple[str, nn.Module | None]]

# what torch FSDP1 and activation checkpointing insert into parameter names
_WRAPPER_NAME_PARTS = re.compile(r"(_fsdp_wrapped_module|_checkpoint_wrapped_module)\.")

# thread ident -> number of active observers registered on that thread
_observing_threads: collections.Counter = collections.Counter()


@contextlib.contextmanager
def scoped_observer(callback: Observer, instances: list[nn.Module] | None) -> Iterator[Observer]:
    """`callback` filtered as [Note: observation] says, while the context is active."""
    owner = threading.get_ident()
    instance_ids = None if instances is None else frozenset(map(id, instances))

    def filtered(op: str, instance: nn.Module, info: dict) -> None:
        if instance_ids is not None:
            if id(instance) in instance_ids:
                callback(op, instance, info)
            return
        emitter = threading.get_ident()
        if emitter == owner or _observing_threads[emitter] == 0:
            callback(op, instance, info)

    _observing_threads[owner] += 1
    try:
        yield filtered
    finally:
        _observing_threads[owner] -= 1


def require_before_first_forward(
    adapter_name: str, model: nn.Module, states: Iterable[Any]
) -> None:
    """RuntimeError once a state in ``states`` ran forward (``_is_root`` set: torch FSDP1, FSDP2
    and fairscale create their streams from the handle at the first forward's lazy init)."""
    if any(state._is_root is not None for state in states):
        raise RuntimeError(
            f"{adapter_name} install_device_handle: {type(model).__name__} already ran forward "
            "(its streams were created from the old handle at lazy init); install the device "
            "handle after wrapping and before the first forward"
        )


def clean_param_name(name: str, segments: Iterable[str] = ()) -> str:
    """`name` as in the unwrapped model: without torch FSDP1's and activation checkpointing's
    segments, nor `segments` (an adapter's `wrapper_segments`, e.g. ``_fpw_module``)."""
    name = _WRAPPER_NAME_PARTS.sub("", name)
    for segment in segments:
        if not segment or "." in segment:
            raise ValueError(
                f"wrapper segment {segment!r}: give one attribute name without dots "
                "(e.g. '_fpw_module')"
            )
        name = re.sub(rf"(?:(?<=\.)|^){re.escape(segment)}\.", "", name)
    return name


# (name, param) -> the options of the parameter's optimizer group (Adapter.optimizer)
GroupOptions = Callable[[str, nn.Parameter], dict[str, Any]]


def group_by(
    named: Iterable[tuple[str, nn.Parameter]], options: GroupOptions
) -> list[dict[str, Any]]:
    """Optimizer parameter groups: parameters with equal ``options(name, param)`` together."""
    groups: dict[tuple, dict[str, Any]] = {}
    for name, param in named:
        group = options(name, param)
        if not isinstance(group, dict) or "params" in group:
            raise TypeError(
                f"param_groups({name!r}, ...) returned {group!r}; return a dict of optimizer "
                "options without 'params' (e.g. {'weight_decay': 0.0}, or {} for the defaults)"
            )
        key = tuple(sorted(group.items()))
        groups.setdefault(key, {**group, "params": []})["params"].append(param)
    return list(groups.values())


_OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def optimizer_class(adapter: Adapter, name: str) -> type[torch.optim.Optimizer]:
    """Torch's optimizer class called `name` ("sgd", "adam", "adamw"); ValueError otherwise."""
    if name not in _OPTIMIZERS:
        raise ValueError(
            f"{adapter.name} optimizer: unknown optimizer {name!r}; use one of "
            f"{sorted(_OPTIMIZERS)}"
        )
    return _OPTIMIZERS[name]


class Adapter:
    """How the suite drives one FSDP implementation: subclass, set `name` and `declarations`,
    implement `_wrap`, `instances`, `training_state`, `root_state` and `_summon_full_params`
    (docs/adapters.md, one table of every protocol name).

    Optional primitives, behind their features: `_observe` (`comm_trace`),
    `_install_device_handle` (`device_handle`), `_assert_state` (`assert_state`). The
    training-loop hooks (`optimizer` ... `on_test_end`) do what a torch user does; an engine
    overrides the ones its implementation names differently (``super()`` is the plain one).
    """

    name: str = "adapter"  # as given to get_adapter
    declarations: Declarations = Declarations()
    wrapping_root: bool | None = None  # while `wrap` runs `_wrap`: its `root` argument

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        refuse_removed_names(cls)

    def wrap(
        self,
        module: nn.Module,
        *,
        process_group: Any = None,
        root: bool | None = None,
        **config: Any,
    ) -> nn.Module:
        """Wrap `module` as an FSDP instance (children first if `auto_wrap_policy` is given).

        Args:
            module: the module to shard; already-wrapped submodules stay their own instances.
            process_group: the group to shard over (None = the default group); with a hybrid
                `sharding_strategy`, the pair (shard_group, replicate_group).
            root: True for the root call, False for a nested one, None when not known (`_wrap`
                reads it as `self.wrapping_root`).
            **config: FSDP1's keywords, [Note: config vocabulary] in features.py.

        Raises:
            UnsupportedFeatureError: the config needs a feature this adapter lacks.
        """
        if root is not None and not isinstance(root, bool):
            raise TypeError(f"{self.name} wrap: root={root!r} must be True, False or None")
        normalized = _negotiated(self, config)
        check_process_group(process_group, normalized)
        wrap_one = _primitive(self, "_wrap")
        previous, self.wrapping_root = self.wrapping_root, root
        try:
            instance = wrap_one(module, process_group, normalized)
        finally:
            self.wrapping_root = previous
        sizes = self.__dict__.setdefault("_group_sizes", weakref.WeakKeyDictionary())
        for wrapped in {id(instance): instance, id(module): module}.values():
            if isinstance(wrapped, nn.Module):
                sizes[wrapped] = _group_size(process_group)
        return instance

    def wrapper(self, *, process_group: Any = None, **config: Any) -> AdapterWrap:
        """A `wrap` callable for the model zoo, its config validated now."""
        _negotiated(self, config)
        if process_group is not None:
            config["process_group"] = process_group
        return AdapterWrap(self, config)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The module that was passed to the root `wrap`."""
        return model

    def instances(self, model: nn.Module) -> list[nn.Module]:
        """FSDP instances in `model`, pre-order (outermost first)."""
        raise FeatureNotImplementedError(self.name, "Adapter.instances")

    def training_state(self, instance: nn.Module) -> InstanceState:
        """The canonical instance state of `instance`."""
        raise FeatureNotImplementedError(self.name, "Adapter.training_state")

    def root_state(self, instance: nn.Module) -> RootState:
        """The canonical coarse (root-level) state of `instance`."""
        raise FeatureNotImplementedError(self.name, "Adapter.root_state")

    def summon_full_params(
        self, model: nn.Module, *, writeback: bool = False
    ) -> contextlib.AbstractContextManager[None]:
        """Context manager: inside, every instance in `model` holds its full parameters
        (`writeback`: changes reach the shards; needs `summon_full_params_writeback`)."""
        if writeback:
            features.require(self, Feature.SUMMON_FULL_PARAMS_WRITEBACK)
        return _primitive(self, "_summon_full_params")(model, writeback)

    def observe(
        self, callback: Observer, instances: Iterable[nn.Module] | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Context manager: report operations to `callback` ([Note: observation])."""
        observe = _primitive(self, "_observe", Feature.COMM_TRACE)
        return observe(callback, None if instances is None else list(instances))

    def install_device_handle(self, model: nn.Module, handle: Any) -> None:
        """Make every instance in `model` use `handle` for streams/events (before forward)."""
        _primitive(self, "_install_device_handle", Feature.DEVICE_HANDLE)(model, handle)

    def assert_state(self, instance: nn.Module, *states: RootState) -> None:
        """The implementation's own assertion that `instance` is in one of `states`
        (`_assert_state`; feature `assert_state`)."""
        _primitive(self, "_assert_state", Feature.ASSERT_STATE)(instance, states)

    def group_size(self, instance: nn.Module) -> int:
        """How many ranks `instance`'s gradients are combined over (its group, recorded by
        `wrap`; else the default group's)."""
        sizes = self.__dict__.get("_group_sizes", {})
        return sizes[instance] if instance in sizes else _group_size(None)

    def save_checkpoint(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: str
    ) -> None:
        """Collective: save model and optimizer state into `directory` (shared by all ranks)."""
        features.unmapped(self, Feature.CHECKPOINT_RESUME, "override Adapter.save_checkpoint")

    def load_checkpoint(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: str
    ) -> None:
        """Collective: load what `save_checkpoint` wrote, also at another world size."""
        features.unmapped(self, Feature.CHECKPOINT_RESUME, "override Adapter.load_checkpoint")

    # The training-loop hooks: what a torch user calls, unless the adapter overrides them.

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
        features.require(self, Feature.PARAM_GROUPS)
        segments = self.declarations.wrapper_segments
        named = (
            (clean_param_name(param_name, segments), param)
            for param_name, param in model.named_parameters()
        )
        return optimizer_type(group_by(named, param_groups), **hyperparameters)

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        """``loss.backward()``."""
        loss.backward()

    def accumulation_boundary(self, model: nn.Module, boundary: bool) -> None:
        """Before each micro-batch's forward of an accumulating step; `boundary`: the last one."""

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Context manager: a backward inside accumulates gradients without reducing them."""
        return _root_method(self, model, "no_sync", Feature.GRADIENT_ACCUMULATION)()

    def clip_grad_norm_(
        self, model: nn.Module, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip the gradients by their global norm; the norm before clipping (as torch's
        ``clip_grad_norm_`` over the unsharded model)."""
        clip = _root_method(self, model, "clip_grad_norm_", Feature.CLIP_GRAD_NORM)
        return clip(max_norm, norm_type)

    def grad_scaler(self, model: nn.Module, **options: Any) -> Any:
        """The gradient scaler users pair with `model` (``torch.amp.GradScaler``'s protocol); it
        skips the step on every rank when any rank's shard holds an inf or NaN."""
        features.unmapped(
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
            features.unmapped(
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
            features.unmapped(
                self,
                Feature.FULL_STATE_DICT,
                "override Adapter.load_state_dict (assign=True: load_state_dict's assign)",
            )
        model.load_state_dict(state_dict)

    def materialize(self, model: nn.Module, *, device: torch.device) -> None:
        """Materialise a meta-device model on `device` after wrapping (each module's
        ``reset_parameters()`` run once)."""
        features.unmapped(
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
        features.unmapped(
            self,
            Feature.FORWARD_METHOD,
            "override Adapter.register_forward_method (make instance.<name>() run the wrapped "
            "module's method with the instance's parameters unsharded, as forward does)",
        )

    def full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Detached copies of the full parameters by unwrapped name (tied: under each name)."""
        segments = self.declarations.wrapper_segments
        with self.summon_full_params(model):
            return {
                clean_param_name(name, segments): param.detach().clone()
                for name, param in model.named_parameters(remove_duplicate=False)
            }

    def is_unsharded(self, instance: nn.Module) -> bool | None:
        """Whether `instance`'s unsharded parameters are allocated; None: not said."""
        return None

    def on_test_end(self) -> None:
        """After every harness test, before its process groups are destroyed: drop what holds
        them (docs/adapters.md, "Process groups between tests")."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def _negotiated(adapter: Adapter, config: dict[str, Any]) -> dict[str, Any]:
    """The normalised config, or UnsupportedFeatureError for what `adapter` lacks."""
    normalized = normalize_config(config)
    features.require(adapter, *features.features_for(normalized))
    features.require_values(adapter, normalized)
    return normalized


def _primitive(adapter: Adapter, name: str, feature: str | None = None) -> Callable[..., Any]:
    """``adapter.<name>`` (UnsupportedFeatureError first unless `adapter` supports `feature`),
    or FeatureNotImplementedError naming it."""
    if feature is not None:
        features.require(adapter, feature)
    method = getattr(adapter, name, None)
    if method is None:
        raise FeatureNotImplementedError(adapter.name, f"Adapter.{name}", feature)
    return method


def _root_method(adapter: Adapter, model: nn.Module, name: str, feature: str) -> Any:
    """``model.<name>``, or UnsupportedFeatureError: `adapter` lacks `feature`, or the root has no
    such method (naming the hook to override)."""
    features.require(adapter, feature)
    method = getattr(model, name, None)
    if method is None:
        raise UnsupportedFeatureError(
            adapter.name,
            feature,
            f"the root {type(model).__name__} has no {name}(); override Adapter.{name}",
        )
    return method


def _group_size(process_group: Any) -> int:
    import torch.distributed as dist

    if isinstance(process_group, tuple):  # hybrid (shard, replicate): the ranks of the mesh
        return _group_size(process_group[0]) * _group_size(process_group[1])
    return dist.get_world_size(process_group) if dist.is_initialized() else 1


class AdapterWrap:
    """The zoo's `wrap` callable (models.model_base.Wrap): `wrap(module, **overrides)` wraps with
    the config updated by `overrides`; the delay hooks forward to the adapter."""

    def __init__(self, adapter: Adapter, config: dict[str, Any]) -> None:
        self.adapter = adapter
        self.config = dict(config)  # as given, process_group included

    def __call__(self, module: nn.Module, **overrides: Any) -> nn.Module:
        config = {**self.config, **overrides}
        process_group = config.pop("process_group", None)
        root = config.pop("root", False)  # the zoo's wrap callable wraps nested instances
        return self.adapter.wrap(module, process_group=process_group, root=root, **config)

    def delay_before_reduction(
        self, delay: Callable[[], None]
    ) -> contextlib.AbstractContextManager[None]:
        return delay_before_reduction(self.adapter, delay)

    def delay_before_free(
        self, instance: nn.Module, delay: Callable[[], None]
    ) -> contextlib.AbstractContextManager[None]:
        return delay_before_free(self.adapter, instance, delay)

    def __repr__(self) -> str:
        return f"AdapterWrap({self.adapter.name!r}, {self.config!r})"


class ObserverRegistry:
    """Process-wide observers for hooks installed once (patches): a patched function calls
    `emit(op, instance, info)` (skipped while not `active`); each observer gets it filtered by
    `scoped_observer`.

    Args:
        key: the patches' key (``_patching.patch_attribute``), e.g. "fsdp-conformance torch-fsdp1
            comm trace"; needed by `patch` only.
        written_for: ``"<library> <version>"`` the patches were verified against.
        library: the patched library's distribution name.
    """

    def __init__(self, key: str = "", written_for: str = "", library: str = "torch") -> None:
        self._observers: list[Observer] = []
        self._patch_options = {"key": key, "written_for": written_for, "library": library}

    def emit(self, op: str, instance: nn.Module | None, info: dict) -> None:
        if instance is None:  # not created through an adapter
            return
        for observer in list(self._observers):
            observer(op, instance, info)

    @property
    def active(self) -> bool:
        return bool(self._observers)

    def before(
        self, event: Callable[..., OpEvents], always: bool = False
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """``original -> replacement`` (for `patch_attribute` or a per-instance method) that
        first emits each ``(op, instance)`` that ``event`` (called with the same arguments)
        yields -- asked only while someone observes, unless ``always`` (an event that keeps
        state) -- then returns ``original(...)``."""

        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def observed(*args: Any, **kwargs: Any) -> Any:
                if always or self._observers:
                    for op, instance in event(*args, **kwargs):
                        self.emit(op, instance, {})
                return original(*args, **kwargs)

            return observed

        return wrap

    def patch(
        self, owner: Any, attribute: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
    ) -> None:
        """``owner.<attribute>`` replaced by ``make(original)``, once per process (under this
        registry's key)."""
        patch_attribute(owner, attribute, make, **self._patch_options)

    def patch_before(
        self, owner: Any, attribute: str, event: Callable[..., Any], always: bool = False
    ) -> None:
        """``owner.<attribute>`` emitting ``event``'s operations first (`before`)."""
        self.patch(owner, attribute, self.before(event, always))

    @contextlib.contextmanager
    def observing(self, callback: Observer, instances: list[nn.Module] | None) -> Iterator[None]:
        with scoped_observer(callback, instances) as observer:
            self._observers.append(observer)
            try:
                yield
            finally:
                self._observers.remove(observer)


@contextlib.contextmanager
def delay_before_reduction(
    adapter: Adapter, delay: Callable[[], None], instances: Iterable[nn.Module] | None = None
) -> Iterator[None]:
    """While active, `delay()` runs before each gradient reduction (needs `comm_trace`)."""

    def on_op(op: str, instance: nn.Module, info: dict) -> None:
        if op in constants.REDUCE_OPS:
            delay()

    with adapter.observe(on_op, instances):
        yield


@contextlib.contextmanager
def delay_before_free(
    adapter: Adapter, instance: nn.Module, delay: Callable[[], None]
) -> Iterator[None]:
    """While active, `delay()` runs before `instance` frees its unsharded parameters."""

    def on_op(op: str, observed: nn.Module, info: dict) -> None:
        if op == Op.FREE:
            delay()

    with adapter.observe(on_op, [instance]):
        yield
