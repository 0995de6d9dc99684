"""FSDPs of other shapes: the two checks any FSDP can run, and the suite's promises held by a
parametrization/DTensor implementation (tests/suite/simple_fsdp.py).

- ``memory.reshard_after_forward`` and ``wrap.configs_isolated`` pass on impl, torch FSDP1 and
  torch FSDP2 (fairscale and DeepSpeed: their own cells, run with ``--fsdp-impl``; DeepSpeed's
  declared deviation is reproduced below);
- ``simple_fsdp`` -- one all-gather per parameter access, gradients summed -- passes the cells
  the suite used to fail on such an implementation (its loss divided by the *global* world
  size on the MoE expert's one-rank group and on a model saved at world size 1; two forwards per
  backward required bit-exact; one all-gather and one reduction per instance; its reductions,
  DTensor's functional collectives, unseen by ``sharding.hybrid`` -- "0 reduce_scatter" -- and
  ``precision.dtypes`` -- "gradient reductions none observed" -- before the collective observer
  sat at torch's dispatcher), its checks about training states and summon_full_params are not
  applicable with that reason, and its broken variants fail the new checks: a mixed-precision
  policy cached per module class (``wrap.configs_isolated``), gathered parameters kept alive
  until backward (``memory.reshard_after_forward``), gradients reduced in param_dtype
  (``precision.dtypes``).
"""

from __future__ import annotations

import pathlib
import textwrap

import pytest

from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.suite import BaseConfigIsolationTests, BaseReshardAfterForwardTests

pytest_plugins = ["pytester"]


@pytest.fixture(params=("impl", "torch-fsdp1", "torch-fsdp2"))
def fsdp_impl(request: pytest.FixtureRequest) -> str:
    return request.param


class TestReshardAfterForward(BaseReshardAfterForwardTests):
    models = ("nested",)


class TestConfigIsolation(BaseConfigIsolationTests):
    pass


_CHECKS = """
import pytest

from fsdp_conformance.suite import (
    BaseCheckpointResumeTests,
    BaseCollectiveCountTests,
    BaseConfigIsolationTests,
    BaseDDPParityTests,
    BaseForwardVariantsTests,
    BaseHybridShardingTests,
    BasePrecisionTests,
    BaseReshardAfterForwardTests,
    BaseSummonFullParamsTests,
    BaseTrainingStateTests,
)
from fsdp_conformance.suite.test_loops import ResumeCase


class TestParity(BaseDDPParityTests):
    models = ("mixture_of_experts",)
    world_sizes = (2,)
    coverage = "pairwise"
    mixed_precision_models = ()


class TestResume(BaseCheckpointResumeTests):
    # world size 1 = a model on a one-rank group: its loss is scaled by that group's size
    cases = (ResumeCase(2, 1), ResumeCase(1, 2))


class TestTwoForwards(BaseForwardVariantsTests):
    variants = ("two_forwards",)


class TestCounts(BaseCollectiveCountTests):
    pass


class TestReshard(BaseReshardAfterForwardTests):
    pass


class TestIsolation(BaseConfigIsolationTests):
    pass


class TestStates(BaseTrainingStateTests):
    models = ("nested",)


class TestSummon(BaseSummonFullParamsTests):
    pass


class TestHybrid(BaseHybridShardingTests):
    pass


class TestPrecision(BasePrecisionTests):
    policies = ("bf16-reduce-fp32", "bf16-output-fp32")


class TestReducesInParamDtype(BasePrecisionTests):
    policies = ("bf16-reduce-fp32",)
    accumulations = ()

    @pytest.fixture
    def fsdp_impl(self):
        return "simple_fsdp:ReducesInParamDtype"


class TestKeepsGathered(BaseReshardAfterForwardTests):
    models = ("nested",)

    @pytest.fixture
    def fsdp_impl(self):
        return "simple_fsdp:KeepsGathered"


class TestPerClassCache(BaseConfigIsolationTests):
    axes = ("mixed_precision",)

    @pytest.fixture
    def fsdp_impl(self):
        return "simple_fsdp:PerClassCache"
"""


def test_simple_fsdp_passes_and_its_broken_variants_fail(pytester: pytest.Pytester) -> None:
    source = pathlib.Path(__file__).with_name("simple_fsdp.py").read_text()
    pytester.makepyfile(simple_fsdp=source, test_shapes_checks=textwrap.dedent(_CHECKS))
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--fsdp-impl", "simple_fsdp:ADAPTER", "-rfs", timeout=600
    )
    output = result.stdout.str()
    failed = sorted(
        line.split(" ")[1].split("::")[1]
        for line in output.splitlines()
        if line.startswith("FAILED ")
    )
    # the broken variants fail their check, and nothing else fails
    assert failed == ["TestKeepsGathered", "TestPerClassCache", "TestReducesInParamDtype"], output
    assert "still hold unsharded parameters" in output, output
    assert "used unsharded parameters in another dtype" in output, output
    reduced = "gradient reductions ['reduce_scatter in torch.bfloat16'], expected every one in"
    assert reduced in output, output
    outcomes = result.parseoutcomes()
    # parity on the MoE (pairwise configs), resume 2 -> 1 and 1 -> 2, two forwards (2),
    # counts (4), reshard after forward (2), isolation (2), hybrid (2), precision (3)
    assert outcomes.get("passed", 0) >= 20, outcomes
    for subject in ("'training_states'", "'summon_full_params'"):
        assert f"does not support {subject}" in output, output


@pytest.mark.world_size(2)
def test_deepspeed_zero3_keeps_parameters_after_forward_from_the_second_step(dist) -> None:
    """The reproduction of DeepSpeed's memory.reshard_after_forward deviation: ZeRO-3 releases
    a module's parameters after its forward in the first iteration only."""
    from fsdp_conformance.adapters import Feature, get_adapter
    from fsdp_conformance.suite import training

    adapter = get_adapter("deepspeed")
    if adapter_features.why_unsupported(adapter, Feature.FULL_SHARD) is not None:
        pytest.skip(adapter_features.why_unsupported(adapter, Feature.FULL_SHARD))
    config = {"sharding_strategy": "FULL_SHARD"}
    root, zoo_model = training.build(adapter, "nested", dist, config)
    optimizer = adapter.optimizer(root, "sgd", lr=training.LR)
    gathered = []  # per step: parameter name -> whether it holds its full data after forward
    for _ in range(2):
        optimizer.zero_grad()
        inputs = zoo_model.get_input(dist.device)
        output = root(*inputs)
        gathered.append({n: p.data.numel() > 0 for n, p in zoo_model.named_parameters()})
        training.adapter_backward(adapter, root, zoo_model.get_loss(inputs, output))
        optimizer.step()
    assert not any(gathered[0].values()), gathered[0]
    assert all(gathered[1].values()), gathered[1]


@pytest.mark.world_size(2)
def test_simple_fsdp_reductions_are_observed_with_their_dtypes(dist, monkeypatch) -> None:
    """simple_fsdp communicates only through DTensor's functional collectives: the collective
    observer sees its all-gathers in param_dtype and its reduce-scatters in reduce_dtype."""
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent))
    import torch
    from simple_fsdp import ADAPTER

    from fsdp_conformance.observe.comm_trace import observing_collectives
    from fsdp_conformance.suite import training

    mixed = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    root, zoo_model = training.build(ADAPTER, "nested", dist, {"mixed_precision": mixed})
    calls = []
    with observing_collectives(calls.append):
        inputs = zoo_model.get_input(dist.device)
        training.adapter_backward(ADAPTER, root, zoo_model.get_loss(inputs, root(*inputs)))
    seen = {(call.op, call.name, call.dtypes, call.group is dist.group) for call in calls}
    assert seen == {
        ("all_gather", "_c10d_functional.all_gather_into_tensor", (torch.bfloat16,), True),
        ("reduce_scatter", "_c10d_functional.reduce_scatter_tensor", (torch.float32,), True),
    }, seen


@pytest.mark.world_size(2)
def test_simple_fsdp_unties_tied_weights(dist, monkeypatch) -> None:
    """The reproduction of simple_fsdp's declared parity.ddp deviation: the zoo transformer's
    tied embedding / output weight becomes two shards."""
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent))
    from simple_fsdp import ADAPTER

    from fsdp_conformance.suite import training

    _, zoo_model = training.build(ADAPTER, "transformer", dist, {})
    shards = [
        module.parametrizations.weight.original
        for module in (zoo_model.embed_tokens, zoo_model.output_proj)
    ]
    assert shards[0] is not shards[1]
