"""The config dimensions the suite's checks cover, and the cases they are parametrised with.

A *case* is one model, one world size and one wrap config in the adapter vocabulary
(docs/adapters.md). Its pytest id names every value, so a failing test names its exact config:
``nested-ws2-FULL_SHARD-bwd=BACKWARD_PRE-fwd=0-limit=default-offload=0-init=after``.

[Note: coverage]
At world size 2 the parity check runs the product of every dimension below (``"full"``, 216
configs per model) or a greedy set of configs in which every pair of values of any two
dimensions occurs at least once (``"pairwise"``, 15 configs per model, starting from the
default config and each single change of it): a bug that needs two settings together to show
up is still caught, a bug needing three may not be. World sizes 1 and 4 run the default config
per sharding strategy, once with ``backward_prefetch="BACKWARD_PRE"`` and once with None, so an
adapter without backward prefetch is covered there too (world size 4 on a subset of the models:
it only adds reduction order).
``--fsdp-coverage`` overrides a check class's default (``BaseDDPParityTests.coverage``).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest

from fsdp_conformance import constants
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.adapters.features import SHARDING_STRATEGIES

# - Dimensions (adapter vocabulary); the first value of each is the default config
# (SHARDING_STRATEGIES: every strategy of the vocabulary, FULL_SHARD first)
# every backward prefetch of the vocabulary (features.BACKWARD_PREFETCHES) and None (no prefetch)
BACKWARD_PREFETCH_CASES = ("BACKWARD_PRE", None, "BACKWARD_POST")
FORWARD_PREFETCH = (False, True)
# None: the key is not given (the implementation's default: True in the FSDP1 vocabulary). An
# explicit value needs the adapter's `limit_all_gathers` feature, which torch FSDP2 lacks.
LIMIT_ALL_GATHERS = (None, False)
CPU_OFFLOAD = (False, True)
# When the model moves to the compute device (fsdp_conformance.models.DeviceInit values); all
# three are the same on CPU and differ on accelerators.
DEVICE_INITS = ("after", "before", "never")

DIMENSIONS: dict[str, tuple[Any, ...]] = {
    "sharding_strategy": SHARDING_STRATEGIES,
    "backward_prefetch": BACKWARD_PREFETCH_CASES,
    "forward_prefetch": FORWARD_PREFETCH,
    "limit_all_gathers": LIMIT_ALL_GATHERS,
    "cpu_offload": CPU_OFFLOAD,
    "device_init": DEVICE_INITS,
}
COVERAGES = constants.COVERAGES

# Short labels for case ids
_LABELS = {
    "sharding_strategy": None,
    "backward_prefetch": "bwd",
    "forward_prefetch": "fwd",
    "limit_all_gathers": "limit",
    "cpu_offload": "offload",
    "device_init": "init",
}


@dataclasses.dataclass(frozen=True)
class ParityCase:
    """One model, world size and config of a suite check (picklable: it travels to the ranks)."""

    # Zoo model name (fsdp_conformance.suite.zoo.MODELS)
    model: str
    # Ranks
    world_size: int
    # (dimension, value) pairs in DIMENSIONS order
    settings: tuple[tuple[str, Any], ...]

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
        """`model` at world size N with `config` (for failure messages)."""
        config = ", ".join(f"{key}={value!r}" for key, value in self.settings)
        return f"{self.model} at world size {self.world_size} with {config}"

    def param(self) -> Any:
        """This case as a ``pytest.param`` with its id and its world_size marker."""
        return pytest.param(self, id=self.id, marks=pytest.mark.world_size(self.world_size))


def full_product(dimensions: dict[str, tuple[Any, ...]] = DIMENSIONS) -> list[dict[str, Any]]:
    """Every combination of the dimensions' values."""
    keys = list(dimensions)
    return [dict(zip(keys, values)) for values in itertools.product(*dimensions.values())]


def one_factor_at_a_time(
    dimensions: dict[str, tuple[Any, ...]] = DIMENSIONS,
) -> list[dict[str, Any]]:
    """The default config, then each other value of each dimension with the rest default."""
    defaults = {key: values[0] for key, values in dimensions.items()}
    return [defaults] + [
        {**defaults, key: value} for key, values in dimensions.items() for value in values[1:]
    ]


def pairwise(dimensions: dict[str, tuple[Any, ...]] = DIMENSIONS) -> list[dict[str, Any]]:
    """Configs covering every pair of values of any two dimensions (greedy, deterministic).

    Starts from `one_factor_at_a_time` (so an implementation lacking some features, e.g. torch
    FSDP2 without NO_SHARD, BACKWARD_POST, forward prefetch and the limiter flag, still runs
    every value of the dimensions it supports), then repeatedly adds the config of the full
    product that covers the most pairs not covered yet (the first such in product order).
    """
    keys = list(dimensions)
    candidates = full_product(dimensions)

    def pairs(config: dict[str, Any]) -> set[tuple]:
        return {
            (a, repr(config[a]), b, repr(config[b])) for a, b in itertools.combinations(keys, 2)
        }

    uncovered = set().union(*(pairs(config) for config in candidates))
    chosen = one_factor_at_a_time(dimensions)
    for config in chosen:
        uncovered -= pairs(config)
    while uncovered:
        best = max(candidates, key=lambda config: len(pairs(config) & uncovered))
        chosen.append(best)
        uncovered -= pairs(best)
    return chosen


# backward_prefetch values each sharding strategy runs with at world sizes other than 2: the
# default and "off", so an adapter without backward prefetch is covered there too
PER_STRATEGY_PREFETCHES = ("BACKWARD_PRE", None)


def per_strategy(dimensions: dict[str, tuple[Any, ...]] = DIMENSIONS) -> list[dict[str, Any]]:
    """The default config per sharding strategy, with each of ``PER_STRATEGY_PREFETCHES``."""
    defaults = {key: values[0] for key, values in dimensions.items()}
    prefetches = [
        prefetch
        for prefetch in PER_STRATEGY_PREFETCHES
        if prefetch in dimensions["backward_prefetch"]
    ] or [dimensions["backward_prefetch"][0]]
    return [
        {**defaults, "sharding_strategy": strategy, "backward_prefetch": prefetch}
        for strategy in dimensions["sharding_strategy"]
        for prefetch in prefetches
    ]


def configs_for(
    coverage: str, dimensions: dict[str, tuple[Any, ...]] = DIMENSIONS
) -> list[dict[str, Any]]:
    """The configs of a coverage level (see [Note: coverage])."""
    if coverage == "full":
        return full_product(dimensions)
    if coverage == "pairwise":
        return pairwise(dimensions)
    raise ValueError(f"unknown coverage {coverage!r}; use one of {', '.join(COVERAGES)}")


def supported_dimensions(
    adapter: Any, dimensions: dict[str, tuple[Any, ...]] = DIMENSIONS
) -> dict[str, tuple[Any, ...]]:
    """`dimensions` without the values `adapter` cannot run (no cell for a value it lacks).

    A value is kept when the wrap config holding only it needs no feature the adapter lacks
    and is not among its ``unsupported_values()``; ``device_init`` values are kept. Pairs are
    then built over the values the implementation has: fairscale, which lacks FSDP1's default
    ``BACKWARD_PRE``, still gets every pair of the values it has. A dimension left without
    values keeps its first one (its cases then skip, naming the feature).
    """
    kept: dict[str, tuple[Any, ...]] = {}
    for key, values in dimensions.items():
        if key == "device_init":
            kept[key] = values
            continue
        runnable = tuple(value for value in values if _runs(adapter, key, value))
        kept[key] = runnable or values[:1]
    return kept


def _runs(adapter: Any, key: str, value: Any) -> bool:
    if key == "limit_all_gathers" and value is None:
        return True  # the key is not given
    config = {key: value}
    try:
        if not adapter_features.supports(
            adapter, *adapter_features.wrap_features(adapter, **config)
        ):
            return False
        adapter_features.require_values(adapter, _normalized(config))
    except Exception:  # noqa: BLE001 -- a refused value (UnsupportedFeatureError) or a bad one
        return False
    return True


def _normalized(config: dict[str, Any]) -> dict[str, Any]:
    from fsdp_conformance.adapters.features import normalize_config

    return normalize_config(config)


def dimensions_for_impl(impl: str | None) -> dict[str, tuple[Any, ...]]:
    """``supported_dimensions`` of the adapter named ``impl`` (``--fsdp-impl``), resolved in
    the collecting process; every dimension when it cannot be resolved there (the ranks then
    report the adapter's error)."""
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
    """The cases of the parity check (see [Note: coverage]).

    Args:
        models: zoo model names.
        coverage: "full" or "pairwise", for world size 2.
        world_sizes: which of 1, 2, 4 (others get one config per strategy, like 1 and 4).
        large_world_models: the models run at world sizes above 2.
        dimensions: the values to cover (``supported_dimensions`` of the adapter under test).
    """
    cases = []
    for world_size in world_sizes:
        configs = configs_for(coverage, dimensions) if world_size == 2 else per_strategy(dimensions)
        for model in models:
            if world_size > 2 and model not in large_world_models:
                continue
            cases.extend(ParityCase(model, world_size, tuple(config.items())) for config in configs)
    return cases
