"""The sharding checks (suite/test_sharding.py) against the built-in adapters, and each of them,
and the sharper DDP parity, failing on an FSDP broken in the way it checks.

The built-in run: ``sharding.uneven`` on all five adapters (fairscale and DeepSpeed skip with
the install line when their extra is missing), ``sharding.hybrid`` on torch FSDP1 and FSDP2
(impl, fairscale and DeepSpeed are not applicable: their reasons are checked here too).
The broken run: one pytest subprocess (pytester) of a test file defining the broken variants.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from fsdp_conformance.adapters import Feature, get_adapter
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.suite import BaseHybridShardingTests, BaseUnevenShardingTests

pytest_plugins = ["pytester"]


@pytest.fixture(params=("impl", "torch-fsdp1", "torch-fsdp2", "fairscale", "deepspeed"))
def fsdp_impl(request: pytest.FixtureRequest) -> str:
    return request.param


class TestUnevenSharding(BaseUnevenShardingTests):
    pass


class TestHybridSharding(BaseHybridShardingTests):
    @pytest.fixture(params=("torch-fsdp1", "torch-fsdp2"))
    def fsdp_impl(self, request: pytest.FixtureRequest) -> str:
        return request.param


@pytest.mark.parametrize("name", ["impl", "fairscale", "deepspeed"])
def test_hybrid_not_applicable_says_why(name: str) -> None:
    reason = adapter_features.why_unsupported(get_adapter(name), Feature.HYBRID_SHARD)
    assert reason, f"adapter {name!r} must declare hybrid_shard unsupported with a reason"


BROKEN = textwrap.dedent(
    '''
    from __future__ import annotations

    import pytest
    import torch
    import torch.distributed as dist

    from fsdp_conformance.adapters.impl import ImplAdapter
    from fsdp_conformance.adapters.torch_fsdp1 import TorchFSDP1Adapter
    from fsdp_conformance.impl import flat_param
    from fsdp_conformance.suite import (
        BaseDDPParityTests,
        BaseHybridShardingTests,
        BaseUnevenShardingTests,
    )


    class DropsRemainder(ImplAdapter):
        """impl whose shards lose the elements past the last whole multiple of the world size
        (a shard computation that drops the remainder)."""

        name = "drops-remainder"

        def _wrap(self, module, process_group, config):
            wrapped = super()._wrap(module, process_group, config)
            handle = wrapped._fsdp_state.handle
            if handle is not None and handle.sharded:
                kept = handle.numel - handle.numel % handle.world_size
                start = handle.rank * handle.shard_numel
                with torch.no_grad():
                    handle.flat_param.data[max(kept - start, 0) :].zero_()
            return wrapped


    class AllReducesOverWorld(TorchFSDP1Adapter):
        """torch FSDP1 whose HYBRID_SHARD all-reduces the reduce-scattered gradient over the
        whole world instead of across the replicas."""

        name = "all-reduces-over-world"

        def _wrap(self, module, process_group, config):
            wrapped = super()._wrap(module, process_group, config)
            for instance in self.instances(wrapped):
                if getattr(instance, "_inter_node_pg", None) is not None:
                    instance._inter_node_pg = dist.group.WORLD
            return wrapped


    class SumsIntoZeroedGrad(ImplAdapter):
        """impl adding the *summed* (not averaged) gradient into a gradient that exists already
        (after zero_grad(set_to_none=False)); with set_to_none=True every step, as the parity
        check ran before, nothing differs."""

        name = "sums-into-zeroed-grad"

        def _wrap(self, module, process_group, config):
            wrapped = super()._wrap(module, process_group, config)
            if wrapped._fsdp_state.handle is not None:
                wrapped._fsdp_state.handle._mutant_sums = True
            return wrapped


    _finish = flat_param.FlatParamHandle.finish_grad_reduction


    def _broken_finish(self, pending):
        if getattr(self, "_mutant_sums", False) and self.flat_param.grad is not None:
            pending.work is None or pending.work.wait()
            self.flat_param.grad += pending.output * self.world_size
            return
        return _finish(self, pending)


    flat_param.FlatParamHandle.finish_grad_reduction = _broken_finish


    def _impl(attr):
        @pytest.fixture
        def fsdp_impl(self):
            return f"test_broken_sharding:{attr}"

        return fsdp_impl


    class TestDropsRemainder(BaseUnevenShardingTests):
        fsdp_impl = _impl("DropsRemainder")


    class TestAllReducesOverWorld(BaseHybridShardingTests):
        fsdp_impl = _impl("AllReducesOverWorld")


    class TestSumsIntoZeroedGrad(BaseDDPParityTests):
        models = ("nested",)
        world_sizes = (2,)
        coverage = "pairwise"
        fsdp_impl = _impl("SumsIntoZeroedGrad")
    '''
)

SELECTED = [
    "TestDropsRemainder::test_uneven_shards_match_ddp[FULL_SHARD]",
    "TestAllReducesOverWorld::test_hybrid_matches_ddp[HYBRID_SHARD]",
    "TestSumsIntoZeroedGrad::test_matches_ddp[nested-ws2-FULL_SHARD-bwd=BACKWARD_PRE-fwd=0-"
    "limit=default-offload=0-init=after]",
]


def test_each_sharding_check_fails_on_its_broken_variant(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_broken_sharding=BROKEN)
    selected = [f"test_broken_sharding.py::{test}" for test in SELECTED]
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rf", "-n", "0", *selected)
    result.assert_outcomes(failed=len(SELECTED))
    result.stdout.fnmatch_lines(
        [
            (
                "*: adapter 'drops-remainder', uneven at world size 3 with "
                "sharding_strategy='FULL_SHARD': losses differ from DDP's at step 0*"
            ),
            (
                "*: adapter 'all-reduces-over-world', nested at world size 4 with "
                "sharding_strategy='HYBRID_SHARD' on a 2 x 2 mesh: collectives break the hybrid "
                "promise*"
            ),
            "*step 0: all_reduce over ranks [[]0, 1, 2, 3[]], neither the shard nor the replicate*",
            (
                "*: adapter 'sums-into-zeroed-grad', nested at world size 2 *: after "
                "step 1's backward, this rank's gradient shard of * differs from DDP's gradient*"
            ),
        ],
        consecutive=False,
    )


def test_hybrid_process_group_is_validated_where_it_enters() -> None:
    adapter = get_adapter("torch-fsdp1")
    module = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"needs process_group=\(shard_group, replicate_group\)"):
        adapter.wrap(module, sharding_strategy="HYBRID_SHARD")
    with pytest.raises(ValueError, match="is a \\(shard, replicate\\) pair: give it with"):
        adapter.wrap(module, process_group=(object(), object()), sharding_strategy="FULL_SHARD")
