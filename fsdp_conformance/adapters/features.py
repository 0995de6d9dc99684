"""Feature names an adapter declares, the wrap config's vocabulary, and negotiation.

[Note: config vocabulary]
`wrap(module, **config)` takes FSDP1's keywords; an enum key accepts a member name (any case) or
any enum member of that name. Keys not given keep the implementation's default. Normalised:

  sharding_strategy   "FULL_SHARD" | "SHARD_GRAD_OP" | "NO_SHARD" | "HYBRID_SHARD" |
                      "_HYBRID_SHARD_ZERO2" (hybrid: process_group=(shard, replicate))
  backward_prefetch   None | "BACKWARD_PRE" | "BACKWARD_POST"
  forward_prefetch, limit_all_gathers, sync_module_states, use_orig_params   bool
  cpu_offload         bool   (also None or an object with `.offload_params`)
  mixed_precision     None | MixedPrecisionConfig   (also a dict, FSDP1's MixedPrecision or
                      FSDP2's MixedPrecisionPolicy)
  auto_wrap_policy    None | "always" | callable(module) -> bool   (the root is always wrapped)
  device_id           None | torch.device | int
  ignored_params      tuple of nn.Parameter / nn.Module   (a module stands for its parameters)
  process_group       None | ProcessGroup | (shard_group, replicate_group)   (`wrap`'s keyword)
"""

from __future__ import annotations

import dataclasses
import enum
import re
import unittest
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
from torch import nn

from fsdp_conformance import constants

from ._support import SupportRange, support_problem_of


class Feature:
    """Feature names (plain strings) an adapter can declare."""

    # - Wrap config ([Note: config vocabulary])
    FULL_SHARD = "full_shard"
    SHARD_GRAD_OP = "shard_grad_op"
    NO_SHARD = "no_shard"
    BACKWARD_PREFETCH_NONE = "backward_prefetch_none"  # backward_prefetch=None given explicitly
    BACKWARD_PREFETCH_PRE = "backward_prefetch_pre"
    BACKWARD_PREFETCH_POST = "backward_prefetch_post"
    FORWARD_PREFETCH = "forward_prefetch"  # forward_prefetch=True
    LIMIT_ALL_GATHERS = "limit_all_gathers"  # the flag given explicitly (either value)
    # limit_all_gathers=False switches the memory bound off (the memory-bound check's "must
    # fail" case); a built-in bound (torch FSDP2) takes the flag as a no-op without this
    LIMIT_ALL_GATHERS_OFF = "limit_all_gathers_off"
    CPU_OFFLOAD = "cpu_offload"  # parameters offloaded to CPU
    MIXED_PRECISION = "mixed_precision"  # param_dtype / reduce_dtype
    MIXED_PRECISION_BUFFER_DTYPE = "mixed_precision_buffer_dtype"  # buffers cast too
    AUTO_WRAP_POLICY = "auto_wrap_policy"
    SYNC_MODULE_STATES = "sync_module_states"  # sync_module_states=True
    # - Adapter operations beyond wrap / instances / states / full params
    SUMMON_FULL_PARAMS_WRITEBACK = "summon_full_params_writeback"
    ASSERT_STATE = "assert_state"  # the implementation's own state assertion
    COMM_TRACE = "comm_trace"  # `observe`: all-gathers, frees, reductions labelled by instance
    DEVICE_HANDLE = "device_handle"  # `install_device_handle` (e.g. observe's lagging device)
    # - Training loops around the wrapper (docs/adapters.md, "Training loops")
    GRADIENT_ACCUMULATION = "gradient_accumulation"  # `no_sync(model)`: backward without reduction
    CLIP_GRAD_NORM = "clip_grad_norm"  # `clip_grad_norm_(model, max_norm, norm_type)`
    FROZEN_PARAMETERS = "frozen_parameters"  # a whole wrapped submodule with requires_grad=False
    # frozen and trainable parameters in one instance (FSDP2 natively, FSDP1 use_orig_params)
    FROZEN_PARAMETERS_MIXED = "frozen_parameters_mixed"
    ACTIVATION_CHECKPOINTING = "activation_checkpointing"  # torch.utils.checkpoint in blocks
    # unused parameters in some iterations, two forwards before one backward, no_grad eval
    FORWARD_VARIANTS = "forward_variants"
    CHECKPOINT_RESUME = "checkpoint_resume"  # `save_checkpoint` / `load_checkpoint`
    USE_ORIG_PARAMS = "use_orig_params"  # the use_orig_params=True config key (torch FSDP1)
    # - What users rely on beyond the seed's axes (docs/adapters.md, "User promises")
    MIXED_PRECISION_POLICY = "mixed_precision_policy"  # reduce_dtype != param_dtype, output dtype
    GRAD_SCALER = "grad_scaler"  # `grad_scaler(model)`: the implementation's sharded grad scaler
    FULL_STATE_DICT = "full_state_dict"  # full state dict to / from the plain module's keys
    META_INIT = "meta_init"  # a model built on the meta device, materialised after wrapping
    HYBRID_SHARD = "hybrid_shard"  # shard within a group, replicate across groups (2-D mesh)
    PARAM_GROUPS = "param_groups"  # optimizer parameter groups by the plain module's names
    IGNORED_PARAMS = "ignored_params"  # parameters left unsharded and unreduced by the wrapper
    FORWARD_METHOD = "forward_method"  # a method other than forward running wrapped parameters
    # - What an FSDP of another shape may not have (docs/adapters.md, "FSDPs of other shapes")
    TRAINING_STATES = "training_states"  # `training_state` / `root_state` report real states
    SUMMON_FULL_PARAMS = "summon_full_params"  # `summon_full_params` is the implementation's own
    # - A public API of the implementation's own, driven by the suite's API families (opt-in:
    #   claimed only where `Declarations.api` names its namespace; docs/api_coverage.md)
    FSDP1_API = "fsdp1_api"  # api["fsdp1"]: FullyShardedDataParallel, MixedPrecision, ...
    FSDP2_API = "fsdp2_api"  # api["fsdp2"]: fully_shard, FSDPModule, MixedPrecisionPolicy, ...


ALL_FEATURES: frozenset[str] = frozenset(
    value for key, value in vars(Feature).items() if not key.startswith("_")
)

API_FAMILIES = {Feature.FSDP1_API: "fsdp1", Feature.FSDP2_API: "fsdp2"}  # feature -> family
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
HYBRID_STRATEGIES = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
BACKWARD_PREFETCHES = ("BACKWARD_PRE", "BACKWARD_POST")
ALWAYS_WRAP = constants.ALWAYS_WRAP
CONFIG_KEYS = (
    "sharding_strategy",
    "backward_prefetch",
    "forward_prefetch",
    "limit_all_gathers",
    "cpu_offload",
    "mixed_precision",
    "auto_wrap_policy",
    "sync_module_states",
    "device_id",
    "use_orig_params",
    "ignored_params",
)


_BOOL_KEYS = ("forward_prefetch", "limit_all_gathers", "sync_module_states", "use_orig_params")


@dataclass(frozen=True)
class MixedPrecisionConfig:
    """Mixed precision in the adapter vocabulary (None: keep the parameter dtype)."""

    param_dtype: torch.dtype | None = None  # unsharded parameters (and the all-gather)
    reduce_dtype: torch.dtype | None = None  # gradient reduction
    buffer_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None  # the root's floating-point outputs (FSDP2's)
    # each instance casts its floating-point inputs to param_dtype (None: the default)
    cast_forward_inputs: bool | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, torch.dtype) and value.is_floating_point
            ):
                raise TypeError(
                    f"mixed_precision {name}={value!r}: give a floating-point torch.dtype or None"
                )
        if self.cast_forward_inputs not in (None, True, False):
            raise TypeError(
                f"mixed_precision cast_forward_inputs={self.cast_forward_inputs!r}: give a bool "
                "or None"
            )

    @property
    def needs_policy(self) -> bool:
        """Whether it needs `mixed_precision_policy` (more than one low-precision dtype)."""
        return (
            (self.reduce_dtype is not None and self.reduce_dtype != self.param_dtype)
            or self.output_dtype is not None
            or self.cast_forward_inputs is False
        )


def _enum_name(key: str, value: Any, allowed: tuple[str, ...]) -> str:
    name = value.name if isinstance(value, enum.Enum) else value
    if not isinstance(name, str) or name.upper() not in allowed:
        raise ValueError(f"{key}={value!r} is not one of {', '.join(allowed)} (or their enums)")
    return name.upper()


def normalize_config(config: dict[str, Any]) -> dict[str, Any]:
    """The wrap config with canonical values; raises TypeError/ValueError naming the bad key."""
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise TypeError(
            f"unknown wrap config key(s) {unknown}; the adapter vocabulary is {list(CONFIG_KEYS)}"
            " (process_group is a keyword of wrap itself)"
        )
    out: dict[str, Any] = {}
    for key, value in config.items():
        if key == "sharding_strategy":
            out[key] = _enum_name(key, value, SHARDING_STRATEGIES + HYBRID_STRATEGIES)
        elif key == "backward_prefetch":
            out[key] = None if value is None else _enum_name(key, value, BACKWARD_PREFETCHES)
        elif key in _BOOL_KEYS:
            out[key] = bool(value)
        elif key == "cpu_offload":
            out[key] = bool(getattr(value, "offload_params", value))
        elif key == "mixed_precision":
            out[key] = _mixed_precision(value)
        elif key == "auto_wrap_policy":
            if value is not None and value != ALWAYS_WRAP and not callable(value):
                raise ValueError(
                    f"auto_wrap_policy={value!r}: give None, {ALWAYS_WRAP!r} or a callable "
                    "(module) -> bool"
                )
            out[key] = value
        elif key == "ignored_params":
            out[key] = _ignored(value)
        elif key == "device_id":
            out[key] = value if value is None or isinstance(value, int) else torch.device(value)
    return out


def check_process_group(process_group: Any, config: dict[str, Any]) -> None:
    """ValueError unless `process_group` is a (shard, replicate) pair exactly for a hybrid
    strategy."""
    hybrid = config.get("sharding_strategy") in HYBRID_STRATEGIES
    pair = isinstance(process_group, tuple)
    if hybrid and not (pair and len(process_group) == 2 and None not in process_group):
        raise ValueError(
            f"sharding_strategy={config['sharding_strategy']!r} needs "
            f"process_group=(shard_group, replicate_group), got {process_group!r}"
        )
    if pair and not hybrid:
        raise ValueError(
            f"process_group={process_group!r} is a (shard, replicate) pair: give it with "
            f"sharding_strategy in {HYBRID_STRATEGIES}, or give one process group"
        )


def _mixed_precision(value: Any) -> MixedPrecisionConfig | None:
    if value is None or isinstance(value, MixedPrecisionConfig):
        return value
    fields = tuple(field.name for field in dataclasses.fields(MixedPrecisionConfig))
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise TypeError(f"mixed_precision keys {unknown} are not among {list(fields)}")
        return MixedPrecisionConfig(**value)
    values = {name: getattr(value, name, None) for name in fields}
    if hasattr(value, "cast_root_forward_inputs") and not values["cast_forward_inputs"]:
        # FSDP1's MixedPrecision: its False means "the root casts", not "none casts"
        values["cast_forward_inputs"] = None
    return MixedPrecisionConfig(**values)


def _ignored(value: Any) -> tuple[nn.Parameter | nn.Module, ...]:
    items = () if value is None else tuple(value)
    for item in items:
        if not isinstance(item, (nn.Parameter, nn.Module)):
            raise TypeError(
                f"ignored_params holds {type(item).__name__}; give nn.Parameters and/or "
                "nn.Modules (a module stands for its parameters)"
            )
    return items


def ignored_parameters(config: dict[str, Any]) -> list[nn.Parameter]:
    """The parameters ``ignored_params`` names (modules expanded), each once, in order."""
    found: dict[int, nn.Parameter] = {}
    for item in config.get("ignored_params", ()):
        params = item.parameters() if isinstance(item, nn.Module) else (item,)
        for param in params:
            found.setdefault(id(param), param)
    return list(found.values())


def features_for(config: dict[str, Any]) -> frozenset[str]:
    """The features a normalised wrap config needs."""
    # a true value of one of these config keys needs the feature of the same name
    flags = "forward_prefetch cpu_offload sync_module_states ignored_params use_orig_params"
    needed = {key for key in flags.split() if config.get(key)}
    if config.get("sharding_strategy") in HYBRID_STRATEGIES:
        needed.add(Feature.HYBRID_SHARD)
    elif "sharding_strategy" in config:
        needed.add(config["sharding_strategy"].lower())
    if "backward_prefetch" in config:
        prefetch = config["backward_prefetch"]
        needed.add(
            Feature.BACKWARD_PREFETCH_NONE
            if prefetch is None
            else f"backward_prefetch_{prefetch.removeprefix('BACKWARD_').lower()}"
        )
    if "limit_all_gathers" in config:
        needed.add(Feature.LIMIT_ALL_GATHERS)
    mixed = config.get("mixed_precision")
    if mixed is not None:
        needed.add(Feature.MIXED_PRECISION)
        if mixed.buffer_dtype is not None:
            needed.add(Feature.MIXED_PRECISION_BUFFER_DTYPE)
        if mixed.needs_policy:
            needed.add(Feature.MIXED_PRECISION_POLICY)
    if config.get("auto_wrap_policy") is not None:
        needed.add(Feature.AUTO_WRAP_POLICY)
    return frozenset(needed)


def module_predicate(policy: Any) -> Callable[[nn.Module], bool]:
    """`auto_wrap_policy` ("always" or a predicate) as a predicate on modules."""
    if policy == ALWAYS_WRAP:
        return lambda module: True
    return policy


def fsdp1_style_kwargs(config: dict[str, Any], api: Any) -> dict[str, Any]:
    """A normalised config as keywords of an FSDP1-style constructor (torch FSDP1's or impl's,
    whose `api` module has ``ShardingStrategy``, ``BackwardPrefetch``, ``CPUOffload`` and
    ``MixedPrecision``): ``sharding_strategy``, ``backward_prefetch``, ``forward_prefetch``,
    ``limit_all_gathers``, ``sync_module_states``, ``cpu_offload``, ``mixed_precision`` and
    ``auto_wrap_policy``, each only when given; the caller maps the other keys."""
    passed = ("forward_prefetch", "limit_all_gathers", "sync_module_states")
    kwargs = {key: config[key] for key in passed if key in config}
    if "sharding_strategy" in config:
        kwargs["sharding_strategy"] = api.ShardingStrategy[config["sharding_strategy"]]
    if "backward_prefetch" in config:
        prefetch = config["backward_prefetch"]
        kwargs["backward_prefetch"] = None if prefetch is None else api.BackwardPrefetch[prefetch]
    if "cpu_offload" in config:
        kwargs["cpu_offload"] = api.CPUOffload(offload_params=config["cpu_offload"])
    mixed = config.get("mixed_precision")
    if mixed is not None:
        output = {} if mixed.output_dtype is None else {"output_dtype": mixed.output_dtype}
        kwargs["mixed_precision"] = api.MixedPrecision(
            param_dtype=mixed.param_dtype,
            reduce_dtype=mixed.reduce_dtype,
            buffer_dtype=mixed.buffer_dtype,
            # every instance casts its inputs, as impl and FSDP2 do (FSDP1's default: the root
            # only, so a nested instance may get fp32 activations and fail its matmul)
            cast_forward_inputs=mixed.cast_forward_inputs is not False,
            **output,
        )
    if config.get("auto_wrap_policy") is not None:
        predicate = module_predicate(config["auto_wrap_policy"])

        def fsdp1_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
            return True if recurse else bool(predicate(module))

        kwargs["auto_wrap_policy"] = fsdp1_policy
    return kwargs


def auto_wrap_targets(
    module: nn.Module, policy: Any, *, wrapped: tuple[type, ...] = ()
) -> list[tuple[str, nn.Module]]:
    """(name, submodule) to wrap below `module` when emulating `auto_wrap_policy`: selected,
    with parameters, not of a `wrapped` type; every child before its parent."""
    predicate = module_predicate(policy)
    return [
        (name, submodule)
        for name, submodule in reversed(list(module.named_modules())[1:])
        if not isinstance(submodule, wrapped)
        and any(True for _ in submodule.parameters())
        and predicate(submodule)
    ]


@dataclass(frozen=True)
class Declarations:
    """What an adapter declares about its implementation (``Adapter.declarations``)."""

    # feature -> why this adapter does not support it (on this host)
    unsupported: Mapping[str, str] = field(default_factory=dict)
    # (config key, canonical value) -> why that value is refused though its feature is supported
    unsupported_values: Mapping[tuple[str, Any], str] = field(default_factory=dict)
    known_deviations: tuple[Any, ...] = ()  # deviations.Deviation
    support: tuple[SupportRange, ...] = ()  # outside them every cell is skipped
    # attribute names the wrappers insert into parameter names (base.clean_param_name)
    wrapper_segments: tuple[str, ...] = ()
    # "mean" or "sum" (the suite scales each instance's gradients by its group size)
    grad_reduction: str = "mean"
    instance_states: bool = True  # False: root states only
    # the adapter this one drives the implementation through: its deviations apply here too
    delegates_to: Any = None
    # API family ("fsdp1", "fsdp2") -> the namespace holding that public API under torch's names
    # (e.g. torch.distributed.fsdp); the family's checks call it directly
    api: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.api) - set(API_FAMILIES.values()))
        if unknown:
            raise ValueError(
                f"Declarations(api=...) names unknown API families {unknown}; use "
                f"{sorted(API_FAMILIES.values())} (family -> namespace)"
            )
        undeclared = {
            feature: f"declares no {family} API namespace (Declarations.api[{family!r}])"
            for feature, family in API_FAMILIES.items()
            if family not in self.api
        }
        object.__setattr__(self, "unsupported", {**undeclared, **self.unsupported})


def support_problem(adapter: Any) -> str | None:
    """One line when the installed libraries are outside the adapter's support ranges, else
    None."""
    return support_problem_of(adapter.declarations.support)


class UnsupportedFeatureError(NotImplementedError, unittest.SkipTest):
    """An adapter was asked for a feature (or config value) it does not support; a
    ``unittest.SkipTest``, so any runner skips on it (``_wrap`` may raise it too)."""

    def __init__(self, adapter: str, feature: str, reason: str) -> None:
        super().__init__(f"adapter {adapter!r} does not support {feature!r}: {reason}")
        self.adapter = adapter
        self.feature = feature
        self.reason = reason


class FeatureNotImplementedError(NotImplementedError):
    """An adapter lacks a member every adapter needs, or one for a feature it claims: a FAIL,
    never a skip."""

    def __init__(self, adapter: str, member: str, feature: str | None = None) -> None:
        if feature is None:
            text = (
                f"adapter {adapter!r} does not implement {member}, which every adapter needs: "
                "override it"
            )
        else:
            text = (
                f"adapter {adapter!r} claims feature {feature!r} but does not implement it: "
                f"override {member}, or declare {feature!r} in Declarations.unsupported instead"
            )
        super().__init__(text)
        self.adapter = adapter
        self.member = member  # "Adapter.<member>"
        self.feature = feature  # None: a member every adapter needs


def why_unsupported(adapter: Any, feature: str) -> str | None:
    """Why ``adapter`` does not support ``feature``, or None when it does."""
    if feature not in ALL_FEATURES:
        raise ValueError(f"unknown feature {feature!r}; known: {sorted(ALL_FEATURES)}")
    return adapter.declarations.unsupported.get(feature)


def capabilities(adapter: Any) -> frozenset[str]:
    """The features ``adapter`` supports on this host."""
    return ALL_FEATURES - set(adapter.declarations.unsupported)


def supports(adapter: Any, *features: str) -> bool:
    """Whether ``adapter`` supports every one of ``features``."""
    return all(why_unsupported(adapter, feature) is None for feature in features)


def require(adapter: Any, *features: str) -> None:
    """UnsupportedFeatureError for the first of ``features`` (sorted) ``adapter`` lacks."""
    for feature in sorted(features):
        reason = why_unsupported(adapter, feature)
        if reason is not None:
            raise UnsupportedFeatureError(adapter.name, feature, reason)


def unmapped(adapter: Any, feature: str, reason: str) -> NoReturn:
    """UnsupportedFeatureError for `feature` (its declared reason if not claimed, else `reason`)."""
    require(adapter, feature)
    raise UnsupportedFeatureError(adapter.name, feature, reason)


def skip_unless(adapter: Any, *features: str) -> None:
    """pytest.skip naming the adapter, feature and reason unless all are supported."""
    try:
        require(adapter, *features)
    except UnsupportedFeatureError as error:
        import pytest

        pytest.skip(str(error))


def require_values(adapter: Any, config: dict[str, Any]) -> None:
    """UnsupportedFeatureError for a normalised config value ``adapter`` refuses."""
    for (key, value), reason in adapter.declarations.unsupported_values.items():
        if key in config and config[key] == value:
            raise UnsupportedFeatureError(adapter.name, f"{key}={value!r}", reason)


def wrap_features(**config: Any) -> frozenset[str]:
    """The features a wrap config needs (validated)."""
    return features_for(normalize_config(config))


def claimed_but_not_implemented(
    adapter: Any, error: UnsupportedFeatureError
) -> FeatureNotImplementedError | None:
    """The failure ``error`` stands for when it is a default's "override Adapter.X" for a
    feature ``adapter`` claims (a skip would hide the missing member), else None."""
    member = re.search(r"override (Adapter\.\w+)", error.reason)
    if member is None or error.feature not in ALL_FEATURES:
        return None
    if why_unsupported(adapter, error.feature) is not None:
        return None
    return FeatureNotImplementedError(adapter.name, member.group(1), error.feature)
