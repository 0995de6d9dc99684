"""Collectives per phase, and no gradient reduction inside ``no_sync`` (``comm.counts``,
``comm.no_sync``; [Note: counts as bounds] in comm_checks.py).

    class TestMyCollectiveCounts(BaseCollectiveCountTests):   # pytest collects Test* classes
        pass
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_conformance.adapters import Feature
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.adapters import loop as adapter_loop
from fsdp_conformance.observe.comm_trace import CommTrace

from . import comm_checks, training, zoo
from .declare import check


class BaseCollectiveCountTests:
    """Collectives per phase, counted through the adapter's ``observe`` labels.

    Bounds, not one call per instance ([Note: counts as bounds]): every instance gathered in
    forward, none reduced there; SHARD_GRAD_OP: no backward all-gather; FULL_SHARD: backward
    all-gathers of an instance at most its forward ones;
    every instance reduced, at most once per forward all-gather; inside ``no_sync`` no
    reduction. Counting observer events (one per unshard / reduction the implementation
    reports, whatever the backend issues underneath: torch FSDP1 on gloo calls ``all_gather``
    with a tensor list where NCCL runs ``_allgather_base``) makes the counts
    backend-independent; every zoo instance here owns parameters.
    """

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
        # What no_sync promises, not how many all-gathers it costs (an implementation may keep
        # parameters unsharded through a no_sync backward, e.g. fairscale's root): no gradient
        # reduction inside; the next iteration outside reduces once per instance; the
        # accumulated gradients train exactly as DDP's no_sync does.
        config = {"sharding_strategy": strategy}
        adapter_features.skip_unless(
            fsdp_adapter, *adapter_features.wrap_features(fsdp_adapter, **config)
        )
        adapter_features.skip_unless(fsdp_adapter, Feature.GRADIENT_ACCUMULATION)
        root, _ = training.wrap_model(fsdp_adapter, "nested", dist, config)
        overrides_no_sync = adapter_loop.overrides(fsdp_adapter, "no_sync")
        if not overrides_no_sync and not callable(getattr(root, "no_sync", None)):
            pytest.skip(
                f"adapter {fsdp_adapter.name!r} does not support 'no_sync': its root module has "
                "no no_sync() context manager"
            )
        trace, root = comm_checks.trace_training(
            fsdp_adapter, "nested", dist, config, compute=False, inside_no_sync=lambda i: i == 1
        )
        label = f"adapter {fsdp_adapter.name!r}, nested, {strategy}"
        instances = len(fsdp_adapter.instances(root))
        failures = no_sync_failures(trace, instances, no_sync_iterations=(1,))
        assert not failures, (
            f"no_sync broken ({label}):\n  " + "\n  ".join(failures) + "\ntrace:\n" + trace.render()
        )
        reference = _ddp_no_sync_params(dist, no_sync_iterations=(1,))
        actual = adapter_loop.full_params(fsdp_adapter, root)
        training.assert_same_training(
            f"{label}, iteration 1 inside no_sync (accumulated gradients)",
            training.TrainingResult(torch.zeros(0), actual),
            training.TrainingResult(torch.zeros(0), reference),
        )


def no_sync_failures(
    trace: CommTrace, instances: int, no_sync_iterations: tuple[int, ...]
) -> list[str]:
    """Phases that break no_sync's promise: a reduction inside it, or an instance not reduced
    (or reduced more often than gathered) in a backward outside it ([Note: counts as bounds]).
    All-gathers are not counted (implementation-specific)."""
    return [
        failure
        for failure in comm_checks.count_failures(trace, "", instances, no_sync_iterations)
        if "gradient reductions" in failure
    ]


def _ddp_no_sync_params(dist: Any, no_sync_iterations: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """``nested`` trained as ``trace_training`` does, under DDP (its own ``no_sync``)."""
    model = zoo.build("nested", dist.group, None, dist.device)
    model.to(dist.device)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=dist.group)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=training.LR, momentum=training.MOMENTUM)
    for iteration in range(1, comm_checks.ITERATIONS + 1):
        no_sync = iteration in no_sync_iterations
        with ddp.no_sync() if no_sync else contextlib.nullcontext():
            inputs = model.get_input(dist.device)
            model.run_backward(model.get_loss(inputs, ddp(*inputs)))
        if not no_sync:
            optimizer.step()
            optimizer.zero_grad()
    return {
        name: param.detach().clone()
        for name, param in model.named_parameters(remove_duplicate=False)
    }


class TestCollectiveCounts(BaseCollectiveCountTests):
    pass
