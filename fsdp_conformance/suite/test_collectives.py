"""Collectives per phase, and no gradient reduction inside ``no_sync`` (``comm.counts``,
``comm.no_sync``; [Note: counts as bounds] in comm_checks.py)."""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_conformance.adapters import Adapter, Feature
from fsdp_conformance.adapters import features as adapter_features

from . import comm_checks, training
from .declare import check


class BaseCollectiveCountTests:
    """Collectives per phase as bounds, counted as the adapter's observer events (one per unshard
    / reduction, whatever the backend issues underneath)."""

    @check(
        "comm.counts",
        "collectives per phase",
        features=("comm_trace",),
        case="sharding strategy name",
        case_of="strategy",
    )
    @pytest.mark.world_size(2)
    @pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
    @pytest.mark.parametrize("model_name", comm_checks.TRACE_MODELS)
    def test_counts_per_phase(self, fsdp_adapter: Any, dist: Any, model_name: str, strategy: str):
        config = {"sharding_strategy": strategy}
        trace, root = comm_checks.trace_training(
            fsdp_adapter, model_name, dist, config, compute=False
        )
        instances = len(fsdp_adapter.instances(root))
        comm_checks.assert_counts(
            trace, strategy, instances, f"adapter {fsdp_adapter.name!r}, {model_name}"
        )

    @check(
        "comm.no_sync",
        "no gradient reduction inside no_sync",
        features=("comm_trace",),
        case="sharding strategy name",
        case_of="strategy",
    )
    @pytest.mark.world_size(2)
    @pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
    def test_no_reduction_inside_no_sync(self, fsdp_adapter: Any, dist: Any, strategy: str):
        # no reduction inside no_sync, every instance reduced after it, training as DDP's
        config = {"sharding_strategy": strategy}
        adapter_features.skip_unless(fsdp_adapter, *adapter_features.wrap_features(**config))
        adapter_features.skip_unless(fsdp_adapter, Feature.GRADIENT_ACCUMULATION)
        root, _ = training.build(fsdp_adapter, "nested", dist, config)
        plain = getattr(fsdp_adapter.no_sync, "__func__", None) is Adapter.no_sync
        if plain and not callable(getattr(root, "no_sync", None)):
            pytest.skip(
                f"adapter {fsdp_adapter.name!r} does not support 'no_sync': its root module has "
                "no no_sync() context manager"
            )
        trace, root = comm_checks.trace_training(
            fsdp_adapter, "nested", dist, config, compute=False, inside_no_sync=lambda i: i == 1
        )
        label = f"adapter {fsdp_adapter.name!r}, nested, {strategy}"
        failures = comm_checks.count_failures(trace, "", no_sync_iterations=(1,))
        # all-gathers are not counted (implementation-specific)
        failures = [failure for failure in failures if "gradient reductions" in failure]
        counts = comm_checks.phase_counts(trace)
        comm_checks.raise_failures("no_sync broken", label, failures, trace.render(), counts=counts)
        reference = training.ddp_driver("nested", dist)  # under DDP's own no_sync
        comm_checks.iterate(reference, inside_no_sync=lambda iteration: iteration == 1)
        label += ", iteration 1 inside no_sync (accumulated gradients)"
        training.assert_params(label, fsdp_adapter.full_params(root), reference.params(), 0)


class TestCollectiveCounts(BaseCollectiveCountTests): ...
