"""Each check of the ``fsdp1`` method family (suite/test_fsdp1_methods.py) fails on a torch FSDP1
broken in the way it checks.

One pytest run per group (a subprocess, through pytester) of a file defining broken variants of
torch's FullyShardedDataParallel (a subclass overriding one public method each, as a bug in it
would behave), each served as the ``fsdp1`` API namespace of a torch-fsdp1 adapter, and one suite
class per variant pointing its ``fsdp_impl`` fixture at that adapter.
"""

from __future__ import annotations

import textwrap

import pytest

pytest_plugins = ["pytester"]

BROKEN = textwrap.dedent(
    '''
    from __future__ import annotations

    import contextlib
    import dataclasses
    import types

    import pytest
    import torch
    import torch.distributed.fsdp as fsdp

    from fsdp_conformance.adapters.torch_fsdp1 import TorchFSDP1Adapter
    from fsdp_conformance.suite import BaseFSDP1MethodTests

    FSDP = fsdp.FullyShardedDataParallel


    class KeepsStateDictType(FSDP):
        """state_dict_type() sets the type and never restores the previous one."""

        @staticmethod
        @contextlib.contextmanager
        def state_dict_type(module, state_dict_type, state_dict_config=None, optim_config=None):
            FSDP.set_state_dict_type(module, state_dict_type, state_dict_config, optim_config)
            yield


    class DropsLoadedOptimState(FSDP):
        """optim_state_dict_to_load returns (and loads) no optimizer state."""

        @staticmethod
        def optim_state_dict_to_load(model, optim, osd, is_named_optimizer=False,
                                     load_directly=False, group=None):
            result = FSDP.optim_state_dict_to_load(
                model, optim, osd, is_named_optimizer, False, group
            )
            result = {**result, "state": {}}
            if load_directly:
                optim.load_state_dict(result)
            return result


    class ShardedLoadsNothing(FSDP):
        """load_state_dict under SHARDED_STATE_DICT returns without loading."""

        def load_state_dict(self, state_dict, *args, **kwargs):
            kind = FSDP.get_state_dict_type(self).state_dict_type
            if kind != fsdp.StateDictType.SHARDED_STATE_DICT:
                return super().load_state_dict(state_dict, *args, **kwargs)


    class Rank0OnlyIgnored(FSDP):
        """optim_state_dict under FullOptimStateDictConfig(rank0_only=True) is full everywhere."""

        @staticmethod
        def optim_state_dict(model, optim, optim_state_dict=None, group=None):
            config = FSDP.get_state_dict_type(model).optim_state_dict_config
            if getattr(config, "rank0_only", False):
                return FSDP.full_optim_state_dict(model, optim, rank0_only=False, group=group)
            return FSDP.optim_state_dict(model, optim, optim_state_dict, group)


    class DropsGroup(FSDP):
        """optim_state_dict and scatter_full_optim_state_dict ignore group=."""

        @staticmethod
        def optim_state_dict(model, optim, optim_state_dict=None, group=None):
            return FSDP.optim_state_dict(model, optim, optim_state_dict)

        @staticmethod
        def scatter_full_optim_state_dict(full, model, optim_input=None, optim=None, group=None):
            return FSDP.scatter_full_optim_state_dict(full, model, optim_input, optim)


    class MisKeysFullState(FSDP):
        """full_optim_state_dict swaps the state of two parameters of one shape."""

        @staticmethod
        def full_optim_state_dict(*args, **kwargs):
            full = FSDP.full_optim_state_dict(*args, **kwargs)
            state = full.get("state", {})
            if "odd.bias" in state:
                state["odd.bias"], state["pair.weight"] = state["pair.weight"], state["odd.bias"]
            return full


    class RekeysInReverse(FSDP):
        """rekey_optim_state_dict to PARAM_ID numbers the parameters backwards."""

        @staticmethod
        def rekey_optim_state_dict(osd, key_type, model, optim_input=None, optim=None):
            result = FSDP.rekey_optim_state_dict(osd, key_type, model, optim_input, optim)
            if key_type == fsdp.OptimStateKeyType.PARAM_ID:
                last = len(list(model.parameters())) - 1
                result["state"] = {last - key: value for key, value in result["state"].items()}
            return result


    class FlattenLoadsNothing(FSDP):
        """flatten_sharded_optim_state_dict returns no optimizer state."""

        @staticmethod
        def flatten_sharded_optim_state_dict(sharded, model, optim):
            return {**FSDP.flatten_sharded_optim_state_dict(sharded, model, optim), "state": {}}


    class ZeroGradsShown(FSDP):
        """summon_full_params(with_grads=True) shows zero gradients."""

        @staticmethod
        @contextlib.contextmanager
        def summon_full_params(module, recurse=True, writeback=True, rank0_only=False,
                               offload_to_cpu=False, with_grads=False):
            with FSDP.summon_full_params(
                module, recurse, writeback, rank0_only, offload_to_cpu, with_grads
            ):
                for param in module.parameters():
                    if with_grads and param.grad is not None:
                        param.grad = torch.zeros_like(param.grad)
                yield


    class SummonsEverything(FSDP):
        """summon_full_params ignores rank0_only and recurse=False."""

        @staticmethod
        def summon_full_params(module, recurse=True, writeback=True, rank0_only=False,
                               offload_to_cpu=False, with_grads=False):
            return FSDP.summon_full_params(module, True, writeback, False, offload_to_cpu,
                                           with_grads)


    class NoSyncDropsGradients(FSDP):
        """no_sync() drops the gradients accumulated inside it."""

        @contextlib.contextmanager
        def no_sync(self):
            with super().no_sync():
                yield
            for module in FSDP.fsdp_modules(self):
                if module._flat_param is not None:
                    module._flat_param.grad = None
            for param in self.parameters():
                param.grad = None


    class InfNormAsTwoNorm(FSDP):
        """clip_grad_norm_(norm_type=inf) computes the 2-norm."""

        def clip_grad_norm_(self, max_norm, norm_type=2.0):
            return super().clip_grad_norm_(max_norm, 2.0)


    class IgnoresCommHook(FSDP):
        """register_comm_hook registers nothing."""

        def register_comm_hook(self, state, hook):
            pass


    def _adapter(fsdp_class):
        """torch-fsdp1 whose fsdp1 API namespace has `fsdp_class` as FullyShardedDataParallel."""
        public = {name: getattr(fsdp, name) for name in dir(fsdp) if not name.startswith("_")}
        namespace = types.SimpleNamespace(**{**public, "FullyShardedDataParallel": fsdp_class})

        class Broken(TorchFSDP1Adapter):
            name = fsdp_class.__name__

            @property
            def declarations(self):
                return dataclasses.replace(super().declarations, api={"fsdp1": namespace})

        return Broken()


    def _impl(attr):
        @pytest.fixture
        def fsdp_impl(self):
            return f"test_broken_fsdp1:{attr}"

        return fsdp_impl


    for _class in (
        KeepsStateDictType, DropsLoadedOptimState, ShardedLoadsNothing, Rank0OnlyIgnored,
        DropsGroup, MisKeysFullState, RekeysInReverse, FlattenLoadsNothing, ZeroGradsShown,
        SummonsEverything, NoSyncDropsGradients, InfNormAsTwoNorm, IgnoresCommHook,
    ):
        globals()[f"{_class.__name__.upper()}"] = _adapter(_class)
        _test = type(f"Test{_class.__name__}", (BaseFSDP1MethodTests,), {})
        _test.fsdp_impl = _impl(_class.__name__.upper())
        globals()[_test.__name__] = _test
    '''
)

# (selected tests, the lines the run must show), in two subprocesses (-n spreads them)
GROUPS = {
    "state-dict-types": (
        [
            "TestKeepsStateDictType::test_state_dict_types[sharded_dtensor-flat_params]",
            "TestDropsLoadedOptimState::test_state_dict_types[local-flat_params]",
            "TestShardedLoadsNothing::test_state_dict_types[sharded-orig_params]",
            "TestRank0OnlyIgnored::test_state_dict_types[full_rank0-flat_params]",
            "TestDropsGroup::test_state_dict_types[full-orig_params]",
            "TestDropsGroup::test_optim_state_dicts[scatter-orig_params]",
        ],
        [
            (
                "*'KeepsStateDictType', uneven, sharded_dtensor-flat_params, after it: "
                "get_state_dict_type reports (<StateDictType.SHARDED_STATE_DICT*"
            ),
            (
                "*'DropsLoadedOptimState', uneven, local-flat_params, the step after loading the state "
                "dicts saved a step earlier, full parameters: * differs from the reference*"
            ),
            (
                "*'ShardedLoadsNothing', uneven, sharded-orig_params, the step after loading the state "
                "dicts saved a step earlier, losses: 'losses' differs from the reference*"
            ),
            (
                "*'Rank0OnlyIgnored', uneven, full_rank0-flat_params, the optimizer state dict: "
                "rank0_only=True, yet other ranks than 0 hold*"
            ),
            "*'DropsGroup', uneven, full-orig_params: collectives ran outside the model's group*",
            (
                "*'DropsGroup', uneven, scatter-orig_params: collectives ran outside the model's "
                "group*"
            ),
        ],
    ),
    "optim-summon-hook": (
        [
            "TestMisKeysFullState::test_optim_state_dicts[full-flat_params]",
            "TestRekeysInReverse::test_optim_state_dicts[rekey-orig_params]",
            "TestFlattenLoadsNothing::test_optim_state_dicts[sharded-orig_params]",
            "TestZeroGradsShown::test_summon_options[with_grads-orig_params]",
            "TestSummonsEverything::test_summon_options[rank0_only-flat_params]",
            "TestSummonsEverything::test_summon_options[recurse_false-flat_params]",
            "TestNoSyncDropsGradients::test_summon_options[with_grads-orig_params]",
            "TestInfNormAsTwoNorm::test_summon_options[with_grads-orig_params]",
            "TestIgnoresCommHook::test_comm_hook[FULL_SHARD-flat_params]",
        ],
        [
            (
                "*'MisKeysFullState', uneven, full-flat_params, full_optim_state_dict(rank0_only=False)"
                ": * differs from the reference by*"
            ),
            (
                "*'RekeysInReverse', uneven, rekey-orig_params, rekey_optim_state_dict(..., "
                "OptimStateKeyType.PARAM_ID, unwrapped model) (default)*"
            ),
            (
                "*'FlattenLoadsNothing', uneven, sharded-orig_params, a fresh optimizer loaded with it"
                ", one step, full parameters: * differs from the reference*"
            ),
            (
                "*'ZeroGradsShown', uneven, summon_full_params with_grads-orig_params, the full grads: "
                "* differs from the reference*"
            ),
            (
                "*'SummonsEverything', uneven, summon_full_params rank0_only-flat_params: the "
                "parameters under [[]''[]] show * elements, in full*"
            ),
            (
                "*'SummonsEverything', uneven, summon_full_params recurse_false-flat_params: the "
                "parameters under [[]'odd.', *[]] show * elements, in full*"
            ),
            (
                "*'NoSyncDropsGradients', uneven, summon_full_params with_grads-orig_params, the "
                "full grads: * differs from the reference*"
            ),
            (
                "*'InfNormAsTwoNorm', uneven, summon_full_params with_grads-orig_params, then "
                "clip_grad_norm_(max_norm, norm_type=inf)'s total norm: 'norm' differs*"
            ),
            (
                "*'IgnoresCommHook', uneven, FULL_SHARD-flat_params, a comm hook halving gradients: "
                "the hook was not called in the backward of steps [[]0, 1[]]*"
            ),
        ],
    ),
}


@pytest.mark.parametrize("group", list(GROUPS))
def test_each_fsdp1_method_check_fails_on_its_broken_variant(
    pytester: pytest.Pytester, group: str
) -> None:
    tests, lines = GROUPS[group]
    pytester.makepyfile(test_broken_fsdp1=BROKEN)
    selected = [f"test_broken_fsdp1.py::{test}" for test in tests]
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-rf", "-n", "0", "--fsdp-timeout", "60", *selected
    )
    result.stdout.fnmatch_lines(lines, consecutive=False)
    result.assert_outcomes(failed=len(tests))
