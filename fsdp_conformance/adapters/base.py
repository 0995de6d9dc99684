"""The adapter protocol: how the suite drives one FSDP implementation.

An `Adapter` wraps modules, finds FSDP instances, maps their training states to the canonical
states (`states.py`), reads full parameters, and declares what it supports (`features.py`).
Subclasses implement the `_`-prefixed primitives; the public methods add validation, skips and
shared behaviour. Observer hooks (`observe`, `install_device_handle`) are optional: an adapter
that lacks them simply does not declare `comm_trace` / `device_handle`.

[Note: observation]
`observe(callback, instances=None)` calls `callback(op, instance, info)` for each operation an
instance performs, *before* the operation happens: "all_gather" (issue of an unshard),
"free" (the unsharded parameters are about to be freed), "reduce_scatter" / "all_reduce"
(gradient reduction about to be issued). `instances=None` observes every instance in this
rank: events emitted on the thread that called `observe`, or on a thread that observes
nothing itself (e.g. autograd's device threads on CUDA) -- so threaded ranks (the harness's
`thread` mode) do not see each other's instances. The delay hooks of the model zoo
(`delay_before_reduction`, `delay_before_free`) are built on it, so they need `comm_trace`.
"""

from __future__ import annotations

import collections
import contextlib
import re
import threading
import unittest
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from fsdp_conformance import vocab
from fsdp_conformance.training_states import InstanceState, RootState
from fsdp_conformance.vocab import Op

from .deviations import Deviation, find_deviation
from .features import ALL_FEATURES, Feature, check_process_group, features_for, normalize_config

# callback(op, instance, info) -- see [Note: observation]
Observer = Callable[[str, nn.Module, dict], None]
REDUCE_OPS = vocab.REDUCE_OPS

# Prefixes FSDP wrappers insert into parameter names (torch FSDP1, activation checkpointing)
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


class UnsupportedFeatureError(NotImplementedError, unittest.SkipTest):
    """An adapter was asked for a feature (or config value) it does not support.

    A ``unittest.SkipTest`` too, so any runner (pytest, unittest, the harness's ranks) reports
    it as a skip without knowing adapters. The suite turns it into a skip wherever it is raised
    in a check's body -- also from inside
    an adapter's `_wrap`, for what only the implementation can tell at wrap time.
    """

    def __init__(self, adapter: str, feature: str, reason: str) -> None:
        super().__init__(f"adapter {adapter!r} does not support {feature!r}: {reason}")
        self.adapter = adapter  # the adapter's name
        self.feature = feature  # the feature name (features.Feature)
        self.reason = reason  # why, in words


class FeatureNotImplementedError(NotImplementedError):
    """An adapter lacks a member it needs: one it must have, or one for a feature it claims (does
    not declare in ``unsupported()``). A FAIL of the adapter, never a skip; the message names the
    adapter, the member to implement and the feature to declare unsupported instead."""

    def __init__(self, adapter: str, member: str, feature: str | None = None) -> None:
        if feature is None:
            text = (
                f"adapter {adapter!r} does not implement {member}, which every adapter needs: "
                "override it"
            )
        else:
            text = (
                f"adapter {adapter!r} claims feature {feature!r} but does not implement it: "
                f"override {member}, or declare {feature!r} in unsupported() instead"
            )
        super().__init__(text)
        self.adapter = adapter  # the adapter's name
        self.member = member  # "Adapter.<method>" to override
        self.feature = feature  # the claimed feature (None: a member every adapter needs)


def claimed_but_not_implemented(
    adapter: Adapter, error: UnsupportedFeatureError
) -> FeatureNotImplementedError | None:
    """The failure ``error`` stands for when it is a base default's "override Adapter.X" for a
    feature ``adapter`` claims (a skip would hide that the member was never written), else None.
    """
    member = re.search(r"override (Adapter\.\w+)", error.reason)
    if member is None or error.feature not in ALL_FEATURES:
        return None
    if adapter.unsupported_reason(error.feature) is not None:
        return None
    return FeatureNotImplementedError(adapter.name, member.group(1), error.feature)


def require_before_first_forward(
    adapter_name: str, model: nn.Module, states: Iterable[Any]
) -> None:
    """RuntimeError unless no FSDP state in ``states`` has run forward yet (``_is_root`` is
    still None: torch FSDP1, FSDP2 and fairscale all decide the root, and create their streams
    from the device handle, at the lazy init of the first forward).

    Args:
        adapter_name: the adapter, for the message.
        model: the wrapped model, for the message.
        states: the implementation's per-instance state objects (each with ``_is_root``).
    """
    if any(state._is_root is not None for state in states):
        raise RuntimeError(
            f"{adapter_name} install_device_handle: {type(model).__name__} already ran forward "
            "(its streams were created from the old handle at lazy init); install the device "
            "handle after wrapping and before the first forward"
        )


def clean_param_name(name: str, segments: Iterable[str] = ()) -> str:
    """`name` without the segments FSDP wrappers insert (names of the unwrapped model).

    Args:
        name: a dotted parameter or module name of the wrapped model.
        segments: more wrapper attribute names to remove (an adapter's `wrapper_segments`,
            e.g. fairscale's ``_fpw_module``), besides torch FSDP1's and activation
            checkpointing's.
    """
    name = _WRAPPER_NAME_PARTS.sub("", name)
    for segment in segments:
        if not segment or "." in segment:
            raise ValueError(
                f"wrapper segment {segment!r}: give one attribute name without dots "
                "(e.g. '_fpw_module')"
            )
        name = re.sub(rf"(?:(?<=\.)|^){re.escape(segment)}\.", "", name)
    return name


def flat_grad_pieces(
    names: list[str], numels: list[int], shard_grad: torch.Tensor, shard_start: int
) -> dict[str, tuple[int, torch.Tensor]]:
    """`Adapter.grad_shards` of one flat parameter: parameters `names` (sizes `numels`) lie
    back to back in the flat (padded) parameter, whose elements ``[shard_start, shard_start +
    len(shard_grad))`` this rank's gradient shard `shard_grad` holds."""
    pieces = {}
    offset, shard_end = 0, shard_start + shard_grad.numel()
    for name, numel in zip(names, numels):
        lo, hi = max(offset, shard_start), min(offset + numel, shard_end)
        if hi > lo:
            pieces[name] = (lo - offset, shard_grad[lo - shard_start : hi - shard_start])
        offset += numel
    return pieces

# (name, param) -> the options of the parameter's optimizer group (Adapter.optimizer)
GroupOptions = Callable[[str, nn.Parameter], dict[str, Any]]


def group_by(
    named: Iterable[tuple[str, nn.Parameter]], options: GroupOptions
) -> list[dict[str, Any]]:
    """Optimizer parameter groups: the parameters of `named` with equal ``options(name,
    param)`` in one group (in the order first seen), each group carrying its options."""
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


class Adapter:
    """Base class of adapters. Subclasses set `name` and implement the `_` primitives."""

    # Name given to get_adapter (or the `pkg.module:ATTR` path)
    name: str = "adapter"
    # What the implementation is known to do differently from a check (adapters/deviations.py);
    # a subclass inherits them and may extend: `known_deviations = Base.known_deviations + (...)`
    known_deviations: tuple[Deviation, ...] = ()
    # The adapter this one drives the implementation through, when it wraps another adapter
    # instance: its known deviations apply to this adapter too (checked after this one's own)
    delegates_to: Adapter | None = None
    # Attribute names the implementation's wrappers insert into parameter names, removed by
    # `clean_param_name` (torch FSDP1's `_fsdp_wrapped_module` is always removed)
    wrapper_segments: tuple[str, ...] = ()
    # How gradients are combined across ranks: "mean" (FSDP and DDP average) or "sum" (e.g.
    # torchtitan's SimpleFSDP); under "sum" the suite scales each instance's gradients by its
    # own group size (`group_size`) in the FSDP run, so parity with DDP still holds
    grad_reduction: str = "mean"
    # False: the implementation has no per-instance training state, only root (coarse) states;
    # the training-state checks then check what exists and say what they could not check
    instance_states: bool = True
    # While `_wrap` runs: True for the root (outermost) call, False for a nested one, None when
    # the caller did not say (`wrap(..., root=...)`)
    wrapping_root: bool | None = None

    # ------------------------------------------------------------------ known deviations
    def find_deviation(
        self, check: str, case: Any = None, error: BaseException | None = None
    ) -> Deviation | None:
        """The declared deviation covering `check` / `case`, or None.

        Consults `known_deviations` along `delegation_chain()`: this adapter first, then the
        adapters it delegates to.

        Args:
            check: a registered check id (fsdp_conformance.checks.CHECKS, e.g.
                "misuse.wrap_twice").
            case: the check's case object (None where the check has none).
            error: a failure: only a deviation that covers it (`Deviation.covers`: its
                `raises` and `match`) counts, so several deviations of one check can each
                declare their own failure.

        Raises:
            ValueError: `check` is not a registered check id.
        """
        for adapter in self.delegation_chain():
            deviation = find_deviation(adapter.known_deviations, check, case, error)
            if deviation is not None:
                return deviation
        return None

    def deviation(self, check: str, case: Any = None) -> str | None:
        """The reason of the declared deviation covering `check` / `case`, or None."""
        deviation = self.find_deviation(check, case)
        return None if deviation is None else deviation.reason

    def running_versions(self) -> str:
        """The versions of what this adapter drives, e.g. ``"torch 2.13.0"`` (deviation texts
        carry them next to the version a deviation was measured on)."""
        return f"torch {torch.__version__}"

    def deviation_text(self, deviation: Deviation) -> str:
        """`deviation`'s reason with where it was measured and what runs now."""
        measured = f"measured on {deviation.measured_on}; " if deviation.measured_on else ""
        return f"{deviation.reason} ({measured}running {self.running_versions()})"

    def delegation_chain(self) -> list[Adapter]:
        """This adapter, then the adapter in its `delegates_to`, then that one's, ... (each
        once).

        Raises:
            TypeError: a `delegates_to` is not an Adapter.
        """
        chain: list[Adapter] = [self]
        delegate = self.delegates_to
        while delegate is not None and all(delegate is not seen for seen in chain):
            if not isinstance(delegate, Adapter):
                raise TypeError(
                    f"adapter {self.name!r}: delegates_to is {delegate!r}, not an Adapter; set it "
                    "to the adapter instance this one wraps (or None)"
                )
            chain.append(delegate)
            delegate = delegate.delegates_to
        return chain

    def on_test_end(self) -> None:
        """Called in each rank after every harness test, before non-default process groups are
        destroyed: drop anything cached per process group (the default group survives)."""

    def support_problem(self) -> str | None:
        """None when the installed libraries are inside this adapter's declared, tested support
        range; else one line naming the installed and the supported versions (every cell of the
        adapter then skips with it)."""
        return None

    # ------------------------------------------------------------------ capabilities
    def unsupported(self) -> dict[str, str]:
        """Feature -> reason for each feature this adapter does not support (on this host)."""
        return {}

    def unsupported_values(self) -> dict[tuple[str, Any], str]:
        """(config key, canonical value) -> reason, for values refused although the key's
        feature is supported, e.g. ``{("limit_all_gathers", False): "the limiter is always
        on"}``. Values are compared after normalisation ([Note: config vocabulary]); `wrap` and
        `wrapper` raise UnsupportedFeatureError for them, which the suite reports as a skip."""
        return {}

    def _check_values(self, config: dict[str, Any]) -> None:
        for (key, value), reason in self.unsupported_values().items():
            if key in config and config[key] == value:
                raise UnsupportedFeatureError(self.name, f"{key}={value!r}", reason)

    @property
    def capabilities(self) -> frozenset[str]:
        """The features this adapter supports on this host."""
        return ALL_FEATURES - set(self.unsupported())

    def unsupported_reason(self, feature: str) -> str | None:
        """Why `feature` is unsupported, or None when it is supported."""
        if feature not in ALL_FEATURES:
            raise ValueError(f"unknown feature {feature!r}; known: {sorted(ALL_FEATURES)}")
        return self.unsupported().get(feature)

    def supports(self, *features: str) -> bool:
        """Whether every one of `features` is supported."""
        return all(self.unsupported_reason(feature) is None for feature in features)

    def check(self, *features: str) -> None:
        """Raise UnsupportedFeatureError for the first unsupported feature."""
        for feature in sorted(features):
            reason = self.unsupported_reason(feature)
            if reason is not None:
                raise UnsupportedFeatureError(self.name, feature, reason)

    def require(self, *features: str) -> None:
        """pytest.skip (naming the adapter, feature and reason) unless all are supported."""
        try:
            self.check(*features)
        except UnsupportedFeatureError as error:
            import pytest

            pytest.skip(str(error))

    def features_for(self, **config: Any) -> frozenset[str]:
        """The features a wrap config needs (validates the config)."""
        return features_for(normalize_config(config))

    # ------------------------------------------------------------------ wrapping
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
            root: True for the root (outermost) call, False for a nested one, None when not
                known; `_wrap` reads it as `self.wrapping_root` (an implementation that builds
                one engine per model builds it here, so misuse surfaces at wrap time).
            **config: the seed's FSDP1 keywords, see [Note: config vocabulary] in features.py.

        Raises:
            UnsupportedFeatureError: the config needs a feature this adapter lacks.
        """
        if root is not None and not isinstance(root, bool):
            raise TypeError(f"{self.name} wrap: root={root!r} must be True, False or None")
        normalized = normalize_config(config)
        self.check(*features_for(normalized))
        self._check_values(normalized)
        check_process_group(process_group, normalized)
        previous, self.wrapping_root = self.wrapping_root, root
        try:
            instance = self._wrap(module, process_group, normalized)
        finally:
            self.wrapping_root = previous
        sizes = self.__dict__.setdefault("_group_sizes", weakref.WeakKeyDictionary())
        for wrapped in {id(instance): instance, id(module): module}.values():
            if isinstance(wrapped, nn.Module):
                sizes[wrapped] = _group_size(process_group)
        return instance

    def wrapper(self, *, process_group: Any = None, **config: Any) -> AdapterWrap:
        """A `wrap` callable for the model zoo: `wrapper(**config)(module, **overrides)`.

        The config is validated now (unsupported features raise here, before any model is
        built); `overrides` (e.g. `process_group=expert_group`) replace keys per call.
        """
        normalized = normalize_config(config)
        self.check(*features_for(normalized))
        self._check_values(normalized)
        if process_group is not None:
            config["process_group"] = process_group
        return AdapterWrap(self, config)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The module that was passed to the root `wrap` (the zoo model)."""
        return model

    # ------------------------------------------------------------------ instances and states
    def instances(self, model: nn.Module) -> list[nn.Module]:
        """FSDP instances in `model`, pre-order (outermost first)."""
        raise FeatureNotImplementedError(self.name, "Adapter.instances")

    def training_state(self, instance: nn.Module) -> InstanceState:
        """The canonical instance state of `instance`."""
        raise FeatureNotImplementedError(self.name, "Adapter.training_state")

    def root_state(self, instance: nn.Module) -> RootState:
        """The canonical coarse (root-level) state of `instance`."""
        raise FeatureNotImplementedError(self.name, "Adapter.root_state")

    def is_unsharded(self, instance: nn.Module) -> bool | None:
        """Whether `instance`'s unsharded parameters are currently allocated (optional).

        Not a required primitive: no suite check calls it (an implementation may keep full
        parameters elsewhere, e.g. impl inside summon_full_params). None (the default) means
        the adapter does not say; adapter tests and your own checks may use it.
        """
        return None

    def group_size(self, instance: nn.Module) -> int:
        """How many ranks `instance`'s gradients are combined over: the size of the process
        group it was wrapped on (recorded by `wrap` for the module it returned and the module
        it was given; the default group's size for any other module). An implementation whose
        instances are not what `wrap` returned overrides it."""
        sizes = self.__dict__.get("_group_sizes", {})
        return sizes[instance] if instance in sizes else _group_size(None)

    def assert_state(self, instance: nn.Module, *states: RootState) -> None:
        """Call the implementation's own state assertion (needs `assert_state`)."""
        self.check(Feature.ASSERT_STATE)
        self._assert_state(instance, states)

    # ------------------------------------------------------------------ full parameters
    def summon_full_params(
        self, model: nn.Module, *, writeback: bool = False
    ) -> contextlib.AbstractContextManager[None]:
        """Context manager: inside, every instance in `model` holds its full parameters.

        Args:
            writeback: copy changes made inside back to the shards (needs
                `summon_full_params_writeback`). Off by default: parity only reads.
        """
        if writeback:
            self.check(Feature.SUMMON_FULL_PARAMS_WRITEBACK)
        return self._summon_full_params(model, writeback)

    def full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Detached copies of the full parameters, keyed by the unwrapped model's names.

        Every name is listed, so a tied parameter appears under each of its names: compare with
        ``reference.named_parameters(remove_duplicate=False)``.
        """
        with self.summon_full_params(model):
            return {
                clean_param_name(name, self.wrapper_segments): param.detach().clone()
                for name, param in model.named_parameters(remove_duplicate=False)
            }

    # ------------------------------------------------------------------ observer hooks
    def observe(
        self, callback: Observer, instances: Iterable[nn.Module] | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Context manager: report operations to `callback` (see [Note: observation])."""
        self.check(Feature.COMM_TRACE)
        return self._observe(callback, None if instances is None else list(instances))

    def install_device_handle(self, model: nn.Module, handle: Any) -> None:
        """Make every instance in `model` use `handle` for streams/events (before forward)."""
        self.check(Feature.DEVICE_HANDLE)
        self._install_device_handle(model, handle)

    @contextlib.contextmanager
    def delay_before_reduction(
        self, delay: Callable[[], None], instances: Iterable[nn.Module] | None = None
    ) -> Iterator[None]:
        """While active, `delay()` runs before each gradient reduction (needs `comm_trace`)."""

        def on_op(op: str, instance: nn.Module, info: dict) -> None:
            if op in REDUCE_OPS:
                delay()

        with self.observe(on_op, instances):
            yield

    @contextlib.contextmanager
    def delay_before_free(self, instance: nn.Module, delay: Callable[[], None]) -> Iterator[None]:
        """While active, `delay()` runs before `instance` frees its unsharded parameters."""

        def on_op(op: str, observed: nn.Module, info: dict) -> None:
            if op == Op.FREE:
                delay()

        with self.observe(on_op, [instance]):
            yield

    # ------------------------------------------------------------------ training loop
    def optimizer(
        self,
        model: nn.Module,
        name: str = "sgd",
        *,
        param_groups: GroupOptions | None = None,
        **hyperparameters: Any,
    ) -> torch.optim.Optimizer:
        """The optimizer every check's training loop uses: the implementation's own where it
        owns its master weights and step (an engine), else torch's over `model.parameters()`.

        Args:
            model: the wrapped root.
            name: "sgd", "adam" or "adamw".
            param_groups: ``param_groups(name, param) -> dict`` of group options per parameter
                (needs `param_groups`), ``name`` as in the unwrapped model (`clean_param_name`);
                decide by the name (FSDP1 with use_orig_params and impl hand over flattened,
                one-dimensional parameters). None: one group.
            **hyperparameters: keyword arguments of the torch optimizer (lr, momentum, ...).
        """
        optimizer_class = self._optimizer_class(name)
        if param_groups is None:
            return optimizer_class(model.parameters(), **hyperparameters)
        self.check(Feature.PARAM_GROUPS)
        named = (
            (clean_param_name(param_name, self.wrapper_segments), param)
            for param_name, param in model.named_parameters()
        )
        return optimizer_class(group_by(named, param_groups), **hyperparameters)

    def _optimizer_class(self, name: str) -> type[torch.optim.Optimizer]:
        classes = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
        if name not in classes:
            raise ValueError(
                f"{self.name} optimizer: unknown optimizer {name!r}; use one of {sorted(classes)}"
            )
        return classes[name]

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        """Run backward of `loss` (an engine that scales or owns backward overrides this)."""
        loss.backward()

    def accumulation_boundary(self, model: nn.Module, boundary: bool) -> None:
        """Called before each micro-batch's forward when a step accumulates several
        micro-batches: `boundary` is True for the last one (an optimizer step follows its
        backward), False while more micro-batches will add to the gradients first.

        Default: nothing (gradients accumulate in ``param.grad`` until ``zero_grad``). An
        implementation that must know the boundary before the backward overrides it (DeepSpeed's
        engine: ``set_gradient_accumulation_boundary``; with one micro-batch per step it is never
        called, every backward being a boundary).
        """

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Context manager: a backward inside accumulates gradients without reducing them
        (FSDP1's ``no_sync()``; FSDP2's ``set_requires_gradient_sync(False)``)."""
        self.check(Feature.GRADIENT_ACCUMULATION)
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
        """Clip the gradients of `model` by their global norm; returns the total norm before
        clipping (as ``torch.nn.utils.clip_grad_norm_`` over the unsharded model would)."""
        self.check(Feature.CLIP_GRAD_NORM)
        method = getattr(model, "clip_grad_norm_", None)
        if method is None:
            raise UnsupportedFeatureError(
                self.name,
                Feature.CLIP_GRAD_NORM,
                f"the root {type(model).__name__} has no clip_grad_norm_(); override "
                "Adapter.clip_grad_norm_",
            )
        return method(max_norm, norm_type)

    def save_checkpoint(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: str
    ) -> None:
        """Collective: save model and optimizer state into `directory` (shared by all ranks)
        the implementation's way (e.g. torch.distributed.checkpoint)."""
        self.check(Feature.CHECKPOINT_RESUME)
        raise UnsupportedFeatureError(
            self.name, Feature.CHECKPOINT_RESUME, "override Adapter.save_checkpoint"
        )

    def load_checkpoint(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: str
    ) -> None:
        """Collective: load what `save_checkpoint` wrote, also at another world size."""
        self.check(Feature.CHECKPOINT_RESUME)
        raise UnsupportedFeatureError(
            self.name, Feature.CHECKPOINT_RESUME, "override Adapter.load_checkpoint"
        )

    # ------------------------------------------------------------------ precision (mixed precision policy, grad scaler)
    def grad_scaler(self, model: nn.Module, **options: Any) -> Any:
        """The gradient scaler a user of this implementation pairs with `model` (the
        ``torch.amp.GradScaler`` protocol: scale, unscale_, step, update, get_scale), built with
        `options` (GradScaler's keywords: init_scale, growth_factor, backoff_factor,
        growth_interval). It must skip the step on every rank when any rank's gradient shard
        holds an inf or NaN."""
        self.check(Feature.GRAD_SCALER)
        raise UnsupportedFeatureError(
            self.name,
            Feature.GRAD_SCALER,
            "override Adapter.grad_scaler (return the scaler users pair with this "
            "implementation, e.g. torch's ShardedGradScaler over the model's process group)",
        )

    # ------------------------------------------------------------------ full state dict, meta-device init
    def state_dict(
        self, model: nn.Module, *, rank0_only: bool = False, offload_to_cpu: bool = False
    ) -> dict[str, Any]:
        """The implementation's own full (unsharded) model state dict, keyed like the unwrapped
        module's ``state_dict()``, on every rank.

        Args:
            rank0_only: only rank 0 gets it; the other ranks get an empty dict.
            offload_to_cpu: every tensor of it is on the CPU.
        (Both need `full_state_dict`; the default takes neither: override this method.)
        """
        if rank0_only or offload_to_cpu:
            self.check(Feature.FULL_STATE_DICT)
            raise UnsupportedFeatureError(
                self.name,
                Feature.FULL_STATE_DICT,
                "override Adapter.state_dict (rank0_only: the full state dict on rank 0, empty "
                "elsewhere; offload_to_cpu: its tensors on the CPU)",
            )
        return model.state_dict()

    def load_state_dict(
        self, model: nn.Module, state_dict: dict[str, Any], *, assign: bool = False
    ) -> None:
        """Load a full state dict (the unwrapped module's keys) the implementation's own way.

        Args:
            assign: load as ``nn.Module.load_state_dict(assign=True)`` does (the parameters
                re-assigned, before the first forward); needs `full_state_dict` and an override.
        """
        if assign:
            self.check(Feature.FULL_STATE_DICT)
            raise UnsupportedFeatureError(
                self.name,
                Feature.FULL_STATE_DICT,
                "override Adapter.load_state_dict (assign=True: load_state_dict's assign)",
            )
        model.load_state_dict(state_dict)

    def materialize(self, model: nn.Module, *, device: torch.device) -> None:
        """Materialise, on `device`, a model built on the meta device and wrapped (root and
        nested instances): afterwards no parameter or buffer is on meta, each module initialised
        once by its ``reset_parameters()`` the implementation's documented way (an
        implementation that materialises while wrapping, like torch FSDP1, does nothing here).
        """
        self.check(Feature.META_INIT)
        raise UnsupportedFeatureError(
            self.name,
            Feature.META_INIT,
            "override Adapter.materialize (after wrapping a meta-device model: every parameter "
            "and buffer on `device`, each module's reset_parameters() run once)",
        )

    # ------------------------------------------------------------------ sharding (hybrid)
    def grad_shards(self, model: nn.Module) -> dict[str, tuple[int, torch.Tensor]] | None:
        """This rank's gradient pieces after a backward, by the unwrapped model's names (optional).

        Each value is ``(start, values)``: `values` (1-D) equals the averaged full gradient of
        that parameter, flattened, at ``[start, start + len(values))``. A parameter this rank
        holds nothing of (an empty shard), or without a gradient, may be left out. None (the
        default) means the adapter does not say; parity then compares the full parameters
        after each step only.
        """
        return None


    # ------------------------------------------------------------------ optimizer groups, ignored parameters, other forward methods
    def register_forward_method(self, instance: nn.Module, name: str) -> None:
        """Make ``instance.<name>(...)``, a method other than forward of the wrapped module, run
        as forward does: parameters unsharded while it runs, resharded after, gradients
        reduced (FSDP2's ``register_fsdp_forward_method``). Needs `forward_method`."""
        self.check(Feature.FORWARD_METHOD)
        raise UnsupportedFeatureError(
            self.name,
            Feature.FORWARD_METHOD,
            "override Adapter.register_forward_method (make instance.<name>() run the wrapped "
            "module's method with the instance's parameters unsharded, as forward does)",
        )

    # ------------------------------------------------------------------ primitives
    def _wrap(self, module: nn.Module, process_group: Any, config: dict[str, Any]) -> nn.Module:
        raise FeatureNotImplementedError(self.name, "Adapter._wrap")

    def _summon_full_params(
        self, model: nn.Module, writeback: bool
    ) -> contextlib.AbstractContextManager[None]:
        raise FeatureNotImplementedError(self.name, "Adapter._summon_full_params")

    def _assert_state(self, instance: nn.Module, states: tuple[RootState, ...]) -> None:
        raise FeatureNotImplementedError(self.name, "Adapter._assert_state", Feature.ASSERT_STATE)

    def _observe(
        self, callback: Observer, instances: list[nn.Module] | None
    ) -> contextlib.AbstractContextManager[None]:
        raise FeatureNotImplementedError(self.name, "Adapter._observe", Feature.COMM_TRACE)

    def _install_device_handle(self, model: nn.Module, handle: Any) -> None:
        raise FeatureNotImplementedError(
            self.name, "Adapter._install_device_handle", Feature.DEVICE_HANDLE
        )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def _group_size(process_group: Any) -> int:
    import torch.distributed as dist

    if isinstance(process_group, tuple):  # hybrid (shard, replicate): the ranks of the mesh
        return _group_size(process_group[0]) * _group_size(process_group[1])
    return dist.get_world_size(process_group) if dist.is_initialized() else 1


class AdapterWrap:
    """The zoo's `wrap` callable bound to an adapter and a config (see models.common.Wrap).

    `wrap(module, **overrides)` wraps with the config updated by `overrides`; the delay hooks of
    `models.common.DelayHooks` forward to the adapter.
    """

    def __init__(self, adapter: Adapter, config: dict[str, Any]) -> None:
        self.adapter = adapter  # the adapter that wraps
        self.config = dict(config)  # config keys as given (process_group may be among them)

    def __call__(self, module: nn.Module, **overrides: Any) -> nn.Module:
        config = {**self.config, **overrides}
        process_group = config.pop("process_group", None)
        root = config.pop("root", False)  # the zoo's wrap callable wraps nested instances
        return self.adapter.wrap(module, process_group=process_group, root=root, **config)

    def delay_before_reduction(
        self, delay: Callable[[], None]
    ) -> contextlib.AbstractContextManager[None]:
        return self.adapter.delay_before_reduction(delay)

    def delay_before_free(
        self, instance: nn.Module, delay: Callable[[], None]
    ) -> contextlib.AbstractContextManager[None]:
        return self.adapter.delay_before_free(instance, delay)

    def __repr__(self) -> str:
        return f"AdapterWrap({self.adapter.name!r}, {self.config!r})"


class ObserverRegistry:
    """Process-wide observers for adapters whose hooks are installed once (torch patches).

    A patched torch function calls `emit(op, instance, info)`; every registered observer gets
    the event through its `scoped_observer` filter. Empty registry: `active` is False and the
    patched functions skip `emit`.
    """

    def __init__(self) -> None:
        self._observers: list[Observer] = []  # filtered callbacks, in registration order

    def emit(self, op: str, instance: nn.Module | None, info: dict) -> None:
        if instance is None:  # not created through an adapter: nobody asked about it
            return
        for observer in list(self._observers):
            observer(op, instance, info)

    @property
    def active(self) -> bool:
        return bool(self._observers)

    @contextlib.contextmanager
    def observing(self, callback: Observer, instances: list[nn.Module] | None) -> Iterator[None]:
        with scoped_observer(callback, instances) as observer:
            self._observers.append(observer)
            try:
                yield
            finally:
                self._observers.remove(observer)
