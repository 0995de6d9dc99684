"""The optimizer-group, wrap (shared, ignored) and forward-method checks against the built-in adapters, and each
check failing on an implementation broken the way it checks (one pytester run per group of
broken variants, as tests/suite/test_loops_catch_broken.py does); also torch-fsdp2's clipping
through torch's own ``clip_grad_norm_``, and a torch whose ``clip_grad_norm_`` uses each rank's
local norm failing ``loops.clipping``."""

from __future__ import annotations

import textwrap

import pytest

from fsdp_conformance.suite import (
    BaseForwardMethodTests,
    BaseGradientClippingTests,
    BaseIgnoredParamsTests,
    BaseParamGroupTests,
    BaseSharedParamsTests,
)

pytest_plugins = ["pytester"]


@pytest.fixture(params=("impl", "torch-fsdp1", "torch-fsdp2"))
def fsdp_impl(request: pytest.FixtureRequest) -> str:
    return request.param


class TestParamGroupsBuiltin(BaseParamGroupTests):
    strategies = ("FULL_SHARD",)


class TestSharedParamsBuiltin(BaseSharedParamsTests):
    strategies = ("FULL_SHARD",)


class TestIgnoredParamsBuiltin(BaseIgnoredParamsTests):
    strategies = ("FULL_SHARD",)


class TestForwardMethodBuiltin(BaseForwardMethodTests):
    strategies = ("FULL_SHARD",)


class TestFSDP2ClipsThroughTorch(BaseGradientClippingTests):
    models = ("loops_gains",)
    strategies = ("FULL_SHARD",)
    norm_types = (2.0,)

    @pytest.fixture
    def fsdp_impl(self) -> str:
        return "torch-fsdp2"


def test_ignored_params_config_key_is_validated() -> None:
    from torch import nn

    from fsdp_conformance.adapters.features import (
        features_for,
        ignored_parameters,
        normalize_config,
    )

    linear = nn.Linear(2, 2)
    config = normalize_config({"ignored_params": [linear, linear.weight]})
    assert [id(item) for item in config["ignored_params"]] == [id(linear), id(linear.weight)]
    assert "ignored_params" in features_for(config)
    assert [id(p) for p in ignored_parameters(config)] == [id(linear.weight), id(linear.bias)]
    assert "ignored_params" not in features_for(normalize_config({"ignored_params": ()}))
    with pytest.raises(TypeError, match="ignored_params holds str; give nn.Parameters"):
        normalize_config({"ignored_params": ["trunk"]})


BROKEN = textwrap.dedent(
    """
    from __future__ import annotations

    import pytest
    import torch
    from torch.distributed.tensor import DTensor

    from fsdp_conformance.adapters.impl import ImplAdapter
    from fsdp_conformance.impl import forward, fully_sharded, optim, runtime
    from fsdp_conformance.suite import (
        BaseForwardMethodTests,
        BaseGradientClippingTests,
        BaseIgnoredParamsTests,
        BaseParamGroupTests,
        BaseSharedParamsTests,
    )

    # impl whose optimizer puts every parameter in one group (the group options are lost)
    _optimizer = optim.optimizer
    optim.optimizer = lambda root, cls, options, **defaults: _optimizer(
        root, cls, lambda name, param: {}, **defaults
    )

    # impl that gives a second instance its own copy of a parameter another one flattened
    _collect_params = fully_sharded._collect_params


    def _untying_collect_params(module, ignored):
        for submodule in module.modules():
            for name, param in list(submodule._parameters.items()):
                if getattr(param, "_fsdp_flattened", False):
                    submodule._parameters[name] = torch.nn.Parameter(param.detach().clone())
        return _collect_params(module, ignored)


    fully_sharded._collect_params = _untying_collect_params

    # impl whose register_forward_method registers nothing (the method runs with its
    # instance's parameters sharded), and impl that leaves a registered method's instance
    # unsharded after the step
    class MethodUnregistered(ImplAdapter):
        name = "method-unregistered"

        def _wrap(self, module, process_group, config):
            wrapped = super()._wrap(module, process_group, config)
            wrapped.register_forward_method = lambda name: None
            return wrapped


    class MethodKeepsUnsharded(ImplAdapter):
        name = "method-keeps-unsharded"

        def _wrap(self, module, process_group, config):
            wrapped = super()._wrap(module, process_group, config)
            wrapped._mutant_keeps_unsharded = True
            return wrapped


    _run_as_forward = forward.run_as_forward
    _reshard = runtime.reshard


    def _marking_run_as_forward(state, function, args, kwargs):
        if state.owner.__dict__.get("_mutant_keeps_unsharded") and function is not state.module:
            state.owner.__dict__["_mutant_kept"] = True
        return _run_as_forward(state, function, args, kwargs)


    def _keeping_reshard(state):
        if state.owner.__dict__.get("_mutant_kept"):
            return None
        return _reshard(state)


    forward.run_as_forward = _marking_run_as_forward
    runtime.reshard = _keeping_reshard

    # impl whose auto-wrap forgets the ignored modules (the children shard their parameters)
    _recursive_wrap = fully_sharded._recursive_wrap


    def _forgetting_recursive_wrap(module, policy, ignored, kwargs, only_children):
        kwargs = {**kwargs, "ignored_modules": None}
        return _recursive_wrap(module, policy, set(), kwargs, only_children)


    fully_sharded._recursive_wrap = _forgetting_recursive_wrap

    # a torch whose register_fsdp_forward_method registers nothing, and whose fully_shard
    # shards the parameters it is told to ignore
    import torch.distributed.fsdp as fsdp_api

    fsdp_api.register_fsdp_forward_method = lambda module, name: None
    _fully_shard = fsdp_api.fully_shard


    def _sharding_ignored(module, **kwargs):
        kwargs.pop("ignored_params", None)
        return _fully_shard(module, **kwargs)


    fsdp_api.fully_shard = _sharding_ignored

    # a torch whose clip_grad_norm_ over DTensor gradients uses this rank's local norm
    _clip_grad_norm_ = torch.nn.utils.clip_grad_norm_


    def _local_norm_clip(parameters, max_norm, norm_type=2.0, **kwargs):
        params = [p for p in parameters if p.grad is not None]
        if not any(isinstance(p.grad, DTensor) for p in params):
            return _clip_grad_norm_(params, max_norm, norm_type, **kwargs)
        grads = [p.grad.to_local() for p in params]
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        for grad in grads:
            grad.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm


    torch.nn.utils.clip_grad_norm_ = _local_norm_clip


    def _impl(name):
        @pytest.fixture
        def fsdp_impl(self):
            return name

        return fsdp_impl


    class TestMergedGroups(BaseParamGroupTests):
        fsdp_impl = _impl("impl")
        strategies = ("FULL_SHARD",)


    class TestUntiedShared(BaseSharedParamsTests):
        fsdp_impl = _impl("impl")
        strategies = ("FULL_SHARD",)


    class TestMethodUnregistered(BaseForwardMethodTests):
        fsdp_impl = _impl("test_broken_wrap_optim:MethodUnregistered")
        variants = ("method",)
        strategies = ("FULL_SHARD",)


    class TestMethodKeepsUnsharded(BaseForwardMethodTests):
        fsdp_impl = _impl("test_broken_wrap_optim:MethodKeepsUnsharded")
        variants = ("method",)
        strategies = ("FULL_SHARD",)


    class TestIgnoredUnderAutoWrap(BaseIgnoredParamsTests):
        fsdp_impl = _impl("impl")
        variants = ("auto_wrap",)
        strategies = ("FULL_SHARD",)


    class TestTorchMethodUnregistered(BaseForwardMethodTests):
        fsdp_impl = _impl("torch-fsdp2")
        variants = ("method",)
        strategies = ("FULL_SHARD",)


    class TestTorchShardsIgnored(BaseIgnoredParamsTests):
        fsdp_impl = _impl("torch-fsdp2")
        variants = ("auto_wrap",)
        strategies = ("FULL_SHARD",)


    class TestLocalNormTorchClip(BaseGradientClippingTests):
        fsdp_impl = _impl("torch-fsdp2")
        models = ("loops_gains",)
        strategies = ("FULL_SHARD",)
        norm_types = (2.0,)
    """
)

# (selected tests, the lines the run must show), in one subprocess
GROUPS = {
    "all": (
        [
            "TestMergedGroups::test_param_groups_match_ddp",
            "TestLocalNormTorchClip::test_clipping_matches_ddp",
            "TestUntiedShared::test_shared_parameter_across_instances",
            "TestIgnoredUnderAutoWrap::test_ignored_params",
            "TestMethodUnregistered::test_other_forward_method",
            "TestMethodKeepsUnsharded::test_other_forward_method",
            "TestTorchMethodUnregistered::test_other_forward_method",
            "TestTorchShardsIgnored::test_ignored_params",
        ],
        [
            (
                "*: adapter 'impl', loops_norm, FULL_SHARD, AdamW "
                "with groups*losses differ from DDP's*"
            ),
            (
                "*: adapter 'torch-fsdp2', loops_gains, FULL_SHARD, norm_type=2.0: "
                "total norms returned by clip_grad_norm_ differ from DDP*"
            ),
            (
                "*: adapter 'impl', tied_instances (embed.weight is head.weight, the "
                "two wrapped apart), FULL_SHARD: the wrap was accepted, so training must match "
                "DDP: losses differ from DDP's*"
            ),
            (
                "*: adapter 'impl', loops, FULL_SHARD, blocks.1.0.* ignored, "
                "auto_wrap: ignored parameter 'blocks.1.0.weight' is not registered under its "
                "name as the same nn.Parameter*"
            ),
            (
                "*: adapter 'method-unregistered', loops, FULL_SHARD, method: the "
                "root's own parameters (the trunk's) are sharded while encode uses them (step 0)*"
            ),
            (
                "*: adapter 'method-keeps-unsharded', loops, FULL_SHARD, method: "
                "unsharded parameters left after the step*"
            ),
            (
                "*: adapter 'torch-fsdp2', loops, FULL_SHARD, method: the root's "
                "own parameters (the trunk's) are sharded while encode uses them (step 0)*"
            ),
            (
                "*: adapter 'torch-fsdp2', loops, FULL_SHARD, blocks.1.0.* ignored, "
                "auto_wrap: ignored parameter 'blocks.1.0.weight' is not registered under its "
                "name as the same nn.Parameter*"
            ),
        ],
    ),
}


@pytest.mark.parametrize("group", list(GROUPS))
def test_each_check_fails_on_its_broken_variant(pytester: pytest.Pytester, group: str) -> None:
    tests, lines = GROUPS[group]
    pytester.makepyfile(test_broken_wrap_optim=BROKEN)
    selected = [f"test_broken_wrap_optim.py::{test}" for test in tests]
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rf", "-n", "0", *selected)
    result.assert_outcomes(failed=len(tests))
    result.stdout.fnmatch_lines(lines, consecutive=False)
