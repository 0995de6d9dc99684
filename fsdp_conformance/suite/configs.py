"""The config dimensions the suite's checks cover, and the cases they are parametrised with;
a case's pytest id names every value (``nested-ws2-FULL_SHARD-bwd=None-fwd=0-...``).

[Note: coverage]
At world size 2 the parity check runs the product of the dimensions (``"full"``) or a greedy
set in which every pair of values of any two dimensions occurs (``"pairwise"``); world sizes 1
and 4 run the default config per sharding strategy, with backward prefetch BACKWARD_PRE and
None."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest

from fsdp_conformance import constants
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.adapters.features import SHARDING_STRATEGIES, normalize_config

BACKWARD_PREFETCH_CASES = ("BACKWARD_PRE", None, "BACKWARD_POST")
# the first value of each dimension is the default config
DIMENSIONS: dict[str, tuple[Any, ...]] = {
    "sharding_strategy": SHARDING_STRATEGIES,
    "backward_prefetch": BACKWARD_PREFETCH_CASES,
    "forward_prefetch": (False, True),
    "limit_all_gathers": (None, False),  # None: the key is not given (the implementation's)
    "cpu_offload": (False, True),
    "device_init": ("after", "before", "never"),  # models.DeviceInit (the same on CPU)
}

# each dimension's label in case ids (None: the value alone)
_LABELS = dict(zip(DIMENSIONS, (None, "bwd", "fwd", "limit", "offload", "init"), strict=True))


@dataclasses.dataclass(frozen=True)
class ParityCase:
    """One model, world size and config of a suite check (picklable: it travels to the ranks)."""

    model: str  # a zoo.MODELS name
    world_size: int
    settings: tuple[tuple[str, Any], ...]  # (dimension, value) pairs in DIMENSIONS order

    @property
    def wrap_config(self) -> dict[str, Any]:
        """The adapter wrap config (every dimension except device_init; None limit omitted)."""
        return {
            key: value
            for key, value in self.settings
            if key != "device_init" and not (key == "limit_all_gathers" and value is None)
        }

    @property
    def device_init(self) -> str:
        return dict(self.settings).get("device_init", "after")

    @property
    def id(self) -> str:
        parts = [self.model, f"ws{self.world_size}"]
        for key, value in self.settings:
            label = _LABELS.get(key, key)
            if isinstance(value, bool):
                value = int(value)
            elif key == "limit_all_gathers" and value is None:
                value = "default"
            parts.append(str(value) if label is None else f"{label}={value}")
        return "-".join(parts)

    def describe(self) -> str:
        config = ", ".join(f"{key}={value!r}" for key, value in self.settings)
        return f"{self.model} at world size {self.world_size} with {config}"

    def param(self) -> Any:
        """This case as a ``pytest.param`` with its id and its world_size marker."""
        return pytest.param(self, id=self.id, marks=pytest.mark.world_size(self.world_size))


def _full_product(dimensions: dict[str, tuple[Any, ...]]) -> list[dict[str, Any]]:
    keys = list(dimensions)
    return [dict(zip(keys, v, strict=True)) for v in itertools.product(*dimensions.values())]


def _defaults(dimensions: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    return {key: values[0] for key, values in dimensions.items()}


def pairwise(dimensions: dict[str, tuple[Any, ...]] = DIMENSIONS) -> list[dict[str, Any]]:
    """Configs covering every pair of values of any two dimensions: the default config and each
    single change of it, then greedily the first config covering the most uncovered pairs."""
    keys = list(dimensions)
    candidates = _full_product(dimensions)

    def pairs(config: dict[str, Any]) -> set[tuple]:
        return {
            (a, repr(config[a]), b, repr(config[b])) for a, b in itertools.combinations(keys, 2)
        }

    uncovered = set().union(*(pairs(config) for config in candidates))
    defaults = _defaults(dimensions)
    chosen = [defaults] + [
        {**defaults, key: value} for key, values in dimensions.items() for value in values[1:]
    ]
    for config in chosen:
        uncovered -= pairs(config)
    while uncovered:
        best = max(candidates, key=lambda config: len(pairs(config) & uncovered))
        chosen.append(best)
        uncovered -= pairs(best)
    return chosen


def _per_strategy(dimensions: dict[str, tuple[Any, ...]]) -> list[dict[str, Any]]:
    """The default config per sharding strategy, with backward prefetch BACKWARD_PRE and None
    (those of them the dimensions have), so an adapter without backward prefetch is covered."""
    supported = dimensions["backward_prefetch"]
    prefetches = [prefetch for prefetch in ("BACKWARD_PRE", None) if prefetch in supported]
    prefetches = prefetches or [supported[0]]
    return [
        {**_defaults(dimensions), "sharding_strategy": strategy, "backward_prefetch": prefetch}
        for strategy in dimensions["sharding_strategy"]
        for prefetch in prefetches
    ]


def _configs_for(coverage: str, dimensions: dict[str, tuple[Any, ...]]) -> list[dict[str, Any]]:
    if coverage == "full":
        return _full_product(dimensions)
    if coverage == "pairwise":
        return pairwise(dimensions)
    raise ValueError(f"unknown coverage {coverage!r}; use one of {', '.join(constants.COVERAGES)}")


def supported_dimensions(adapter: Any) -> dict[str, tuple[Any, ...]]:
    """``DIMENSIONS`` without the values `adapter` cannot run (by the features the value needs
    and the adapter's unsupported values); a dimension left empty keeps its first value."""
    kept: dict[str, tuple[Any, ...]] = {}
    for key, values in DIMENSIONS.items():
        if key == "device_init":
            kept[key] = values
            continue
        kept[key] = tuple(value for value in values if _runs(adapter, key, value)) or values[:1]
    return kept


def _runs(adapter: Any, key: str, value: Any) -> bool:
    if key == "limit_all_gathers" and value is None:
        return True  # the key is not given
    config = {key: value}
    try:
        if not adapter_features.supports(adapter, *adapter_features.wrap_features(**config)):
            return False
        adapter_features.require_values(adapter, normalize_config(config))
    except Exception:  # noqa: BLE001 -- a refused value (UnsupportedFeatureError) or a bad one
        return False
    return True


def dimensions_for_impl(impl: str | None) -> dict[str, tuple[Any, ...]]:
    """``supported_dimensions`` of the adapter named ``impl`` (``--fsdp-impl``); every
    dimension when it cannot be resolved here (the ranks then report the adapter's error)."""
    if not impl:
        return DIMENSIONS
    try:
        from fsdp_conformance.adapters import get_adapter

        return supported_dimensions(get_adapter(impl))
    except Exception:  # noqa: BLE001 -- resolution errors are reported by the ranks
        return DIMENSIONS


def parity_cases(
    models: tuple[str, ...],
    coverage: str,
    world_sizes: tuple[int, ...] = (1, 2, 4),
    large_world_models: tuple[str, ...] = (),
    dimensions: dict[str, tuple[Any, ...]] = DIMENSIONS,
) -> list[ParityCase]:
    """The cases of the parity check ([Note: coverage]): ``coverage`` ("full" or "pairwise")
    at world size 2, one config per strategy at the others (``large_world_models`` only above
    2), over ``dimensions`` (``supported_dimensions`` of the adapter under test)."""
    cases = []
    for world_size in world_sizes:
        configs = (
            _configs_for(coverage, dimensions) if world_size == 2 else _per_strategy(dimensions)
        )
        for model in models:
            if world_size > 2 and model not in large_world_models:
                continue
            cases.extend(ParityCase(model, world_size, tuple(config.items())) for config in configs)
    return cases
