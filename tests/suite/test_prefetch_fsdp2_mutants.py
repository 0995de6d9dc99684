"""The prefetch checks hold torch FSDP2 to its mapped prefetch settings and fail on broken ones.

The mutant breaks `FSDPParamGroup._prefetch_unshard` (torch 2.13.0: every forward and backward
prefetch, implicit or from explicit lists, goes through it) inside the rank body with
`mock.patch.object`, which restores it when the block ends.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from fsdp_conformance.adapters import get_adapter
from fsdp_conformance.suite import comm_checks, prefetch_goldens

pytestmark = [pytest.mark.fsdp_mode("process"), pytest.mark.world_size(2)]

ADAPTER = "torch-fsdp2"


def config_of(backward_prefetch):
    return {"sharding_strategy": "FULL_SHARD", "backward_prefetch": backward_prefetch}


def trace_of(dist, config):
    trace, _ = comm_checks.trace_training(get_adapter(ADAPTER), "nested", dist, config)
    return trace


@pytest.mark.parametrize("backward_prefetch", ["BACKWARD_PRE", "BACKWARD_POST"])
def test_fsdp2_prefetches_in_backward_and_matches_its_golden(dist, backward_prefetch):
    config = {**config_of(backward_prefetch), "forward_prefetch": True}
    trace = trace_of(dist, config)
    comm_checks.assert_prefetch_happens(trace, config, "adapter 'torch-fsdp2'")
    case = comm_checks.prefetch_case_id("nested", backward_prefetch, True)
    with mock.patch.dict(os.environ):
        os.environ.pop("EXPECTTEST_ACCEPT", None)  # never rewrite the goldens from here
        prefetch_goldens.check_golden(ADAPTER, case, trace.render(ops=None))


@pytest.mark.parametrize("backward_prefetch", ["BACKWARD_PRE", "BACKWARD_POST"])
def test_check_catches_fsdp2_whose_backward_prefetch_does_nothing(dist, backward_prefetch):
    prefetch_unshard = FSDPParamGroup._prefetch_unshard

    def forward_only(target, pass_type):
        if pass_type != "backward":
            prefetch_unshard(target, pass_type)

    config = config_of(backward_prefetch)
    with mock.patch.object(FSDPParamGroup, "_prefetch_unshard", staticmethod(forward_only)):
        trace = trace_of(dist, config)
    with pytest.raises(AssertionError, match="prefetch does not happen") as failure:
        comm_checks.assert_prefetch_happens(trace, config, "adapter 'torch-fsdp2' (broken)")
    message = str(failure.value)
    assert f"iteration 1 backward: {backward_prefetch} did not prefetch" in message or (
        "iteration 1 backward: BACKWARD_PRE prefetched too late" in message
    ), message
