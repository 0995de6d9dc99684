"""Sharding layouts users rely on, each against DDP (docs/suite.md, "Sharding"): uneven and
empty shards at world size 3 (``sharding.uneven``), hybrid sharding on a 2 x 2 mesh
(``sharding.hybrid``). Tolerances: ``test_parity.tolerance`` (at 3 and 4 ranks the average of
float32 gradients depends on the order; measured within 6e-8, parameters 1.5e-8).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from fsdp_conformance.adapters.features import HYBRID_STRATEGIES
from fsdp_conformance.constants import Op
from fsdp_conformance.observe.comm_trace import CommTrace

from . import test_parity, training
from .declare import check

UNEVEN_MODEL = "uneven"
HYBRID_MODEL = "nested"


@dataclasses.dataclass(frozen=True)
class ShardingCase:
    """The case a sharding check's cell hands to ``Deviation.applies``."""

    model: str  # zoo model name
    sharding_strategy: str  # of every instance


def full_state_dict(adapter: Any, root: nn.Module) -> dict[str, torch.Tensor]:
    """``adapter.state_dict(root)`` by the unwrapped model's names, DTensor values as their
    ``full_tensor()`` (torch FSDP2's default state dict is sharded)."""
    from torch.distributed.tensor import DTensor

    state = adapter.state_dict(root).items()
    full = ((k, v.full_tensor() if isinstance(v, DTensor) else v) for k, v in state)
    return training.by_clean_name(adapter, full)


class BaseUnevenShardingTests:
    """The ``uneven`` model (sizes not divisible by 3, an empty shard, a 1-element parameter)
    trains as DDP at world size 3: losses, gradient shards, full parameters, state dict."""

    STEPS: ClassVar[int] = 3
    strategies: ClassVar[tuple[str, ...]] = ("FULL_SHARD", "SHARD_GRAD_OP")

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        training.parametrize(metafunc, uneven_strategy=self.strategies)

    @check(
        "sharding.uneven",
        "at world size 3, parameters not divisible by 3, an empty shard and a 1-element parameter "
        "train as DDP (losses, gradient shards, full parameters, full state dict)",
        case="suite.test_sharding.ShardingCase",
        case_of=lambda uneven_strategy: ShardingCase(UNEVEN_MODEL, uneven_strategy),
    )
    @pytest.mark.world_size(3)
    def test_uneven_shards_match_ddp(self, fsdp_adapter: Any, dist: Any, uneven_strategy: str):
        config = {"sharding_strategy": uneven_strategy}
        driver = training.fsdp_driver(fsdp_adapter, UNEVEN_MODEL, dist, config)
        result = driver.trained(self.STEPS)
        reference = training.reference_run(UNEVEN_MODEL, dist, self.STEPS)
        atol, rtol = test_parity.tolerance(dist.world_size)
        label = (
            f"adapter {fsdp_adapter.name!r}, {UNEVEN_MODEL} at world size {dist.world_size} "
            f"with sharding_strategy={uneven_strategy!r}"
        )
        training.assert_same_training(label, result, reference, atol, rtol)
        state = full_state_dict(fsdp_adapter, driver.model)
        params = {name: value for name, value in state.items() if name in reference.params}
        label += ", full state dict"
        training.assert_params(label, params, reference.params, self.STEPS, atol, rtol)


def hybrid_groups(dist: Any, shard_size: int = 2) -> tuple[Any, Any]:
    """(shard group, replicate group) of this rank, rows of `shard_size` consecutive ranks
    sharding (4 ranks: shard {0, 1} / {2, 3}, replicate {0, 2} / {1, 3}); every rank creates
    every group, as ``new_group`` needs."""
    import torch.distributed as tdist

    ranks = tdist.get_process_group_ranks(dist.group)
    rows = [tuple(ranks[start : start + shard_size]) for start in range(0, len(ranks), shard_size)]
    # rows, then columns: this rank is in one of each
    groups = {members: tdist.new_group(list(members)) for members in [*rows, *zip(*rows)]}
    shard, replicate = (group for members, group in groups.items() if ranks[dist.rank] in members)
    return shard, replicate


class BaseHybridShardingTests:
    """``HYBRID_SHARD`` and ``_HYBRID_SHARD_ZERO2`` on a 2 x 2 mesh train as DDP, gathering and
    reduce-scattering within the shard group, all-reducing across replicas, nothing else."""

    STEPS: ClassVar[int] = 2
    strategies: ClassVar[tuple[str, ...]] = HYBRID_STRATEGIES

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        training.parametrize(metafunc, hybrid_strategy=self.strategies)

    @check(
        "sharding.hybrid",
        "hybrid sharding on a 2 x 2 mesh trains as DDP at world size 4; gradients "
        "reduce-scattered within the shard group, all-reduced across replicas",
        features=("hybrid_shard", "comm_trace"),
        case="suite.test_sharding.ShardingCase",
        case_of=lambda hybrid_strategy: ShardingCase(HYBRID_MODEL, hybrid_strategy),
        api=(
            "FullyShardedDataParallel(process_group=tuple[ProcessGroup, ProcessGroup])",
            "ShardingStrategy.HYBRID_SHARD",
        ),
    )
    @pytest.mark.world_size(4)
    def test_hybrid_matches_ddp(self, fsdp_adapter: Any, dist: Any, hybrid_strategy: str):
        import torch.distributed as tdist

        shard, replicate = hybrid_groups(dist)
        config = {"sharding_strategy": hybrid_strategy}
        pair = (shard, replicate)
        driver = training.fsdp_driver(fsdp_adapter, HYBRID_MODEL, dist, config, process_group=pair)
        root = driver.model
        trace = CommTrace(fsdp_adapter, root, collectives=True)
        with trace:
            result = driver.trained(self.STEPS, phase=lambda step, _: trace.phase(f"step {step}"))
        label = (
            f"adapter {fsdp_adapter.name!r}, {HYBRID_MODEL} at world size {dist.world_size} with "
            f"sharding_strategy={hybrid_strategy!r} on a 2 x 2 mesh"
        )
        shard_ranks = tuple(tdist.get_process_group_ranks(shard))
        replicate_ranks = tuple(tdist.get_process_group_ranks(replicate))
        groups = {shard_ranks: "shard", replicate_ranks: "replicate"}
        labels = training.trainable_labels(fsdp_adapter, root, trace)
        trainable = sorted(name for name, trains in labels.items() if trains)
        failures = []
        for step in range(self.STEPS):
            failures += _hybrid_step_failures(trace, f"step {step}", groups, trainable)
        assert not failures, (
            f"{label}: collectives break the hybrid promise (shard group "
            f"{list(shard_ranks)}, replicate group {list(replicate_ranks)}):\n  "
            + "\n  ".join(failures)
            + "\ncollectives: "
            + "; ".join(f"{c.phase}: {c.op} over {list(c.ranks)}" for c in trace.collectives)
        )
        reference = training.reference_run(HYBRID_MODEL, dist, self.STEPS)
        training.assert_same_training(
            label, result, reference, *test_parity.tolerance(dist.world_size)
        )


# the (op, group) pairs the hybrid promise allows
_PROMISED = ((Op.ALL_GATHER, "shard"), (Op.REDUCE_SCATTER, "shard"), (Op.ALL_REDUCE, "replicate"))


def _hybrid_step_failures(
    trace: CommTrace, phase: str, groups: dict[tuple[int, ...], str], trainable: list[str]
) -> list[str]:
    """What one step's forward and backward did against the hybrid promise."""
    failures = []
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    for collective in (c for c in trace.collectives if c.phase == phase):
        group = groups.get(collective.ranks)
        if group is None:
            failures.append(
                f"{phase}: {collective.op} over ranks {list(collective.ranks)}, neither the "
                "shard nor the replicate group"
            )
            continue
        counts[collective.op, group] += 1
    for (op, group), count in counts.items():
        if (op, group) not in _PROMISED:
            failures.append(f"{phase}: {count} {op} over the {group} group")
    # each instance's reductions: at most once per all-gather of it ([Note: counts as bounds]
    # in comm_checks.py), once for an instance that never gathers
    gathers = training.events_per_label(trace, phase, (Op.ALL_GATHER,))
    allowed = {label: max(1, gathers.get(label, 0)) for label in trainable}
    for op, group in ((Op.REDUCE_SCATTER, "shard"), (Op.ALL_REDUCE, "replicate")):
        count = counts[op, group]
        if not 1 <= count <= sum(allowed.values()):
            failures.append(
                f"{phase}: {count} {op} over the {group} group; expected 1 to "
                f"{sum(allowed.values())} (at most one per reduction the instances may issue, "
                "fewer where bucketed)"
            )
    reported = training.events_per_label(trace, phase)
    if set(reported) != set(trainable) or any(n > allowed[k] for k, n in reported.items()):
        failures.append(
            f"{phase}: gradient reductions per instance {reported}; expected each of "
            f"{trainable} reduced, at most {allowed} times"
        )
    return failures


class TestUnevenSharding(BaseUnevenShardingTests): ...


class TestHybridSharding(BaseHybridShardingTests): ...
