"""The ``fsdp2_module.*`` checks (suite/test_fsdp2_module.py) pass on torch FSDP2 and each fails
on torch FSDP2 broken in the way it checks.

The broken variants: one pytest run (a subprocess, through pytester) of a test file defining broken variants of
torch FSDP2: each an adapter whose FSDP2 namespace (``Declarations.api["fsdp2"]``) hands out
modules with one ``FSDPModule`` method broken, or marks its modules for a patch of torch's
internals (applied in the ranks when they import the file, active only on marked modules), and
one suite class per variant pointing its ``fsdp_impl`` fixture at it.
"""

from __future__ import annotations

import textwrap

import pytest

from fsdp_conformance.suite import BaseFSDP2ModuleTests

pytest_plugins = ["pytester"]


class TestFSDP2ModuleOnTorchFSDP2(BaseFSDP2ModuleTests):
    """No false failure: every cell passes on torch FSDP2 (the other adapters skip them)."""

    @pytest.fixture
    def fsdp_impl(self) -> str:
        return "torch-fsdp2"


BROKEN = textwrap.dedent(
    '''
    from __future__ import annotations

    import dataclasses
    import functools
    import types

    import pytest
    import torch.distributed.fsdp as fsdp
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState, TrainingState

    from fsdp_conformance.adapters.torch_fsdp2 import TorchFSDP2Adapter
    from fsdp_conformance.suite import BaseFSDP2ModuleTests

    MARK = "_fsdp2_module_mutant"


    def _marked(module, name):
        return getattr(module, MARK, None) == name


    def _adapter(name, **methods):
        """torch-fsdp2 whose namespace's fully_shard marks each module with `name` and replaces
        its `methods` (each broken(module, original_bound_method, *args, **kwargs))."""

        def fully_shard(module, **kwargs):
            wrapped = fsdp.fully_shard(module, **kwargs)
            object.__setattr__(wrapped, MARK, name)
            for method, broken in methods.items():
                original = getattr(wrapped, method)
                object.__setattr__(wrapped, method, functools.partial(broken, wrapped, original))
            return wrapped

        public = {key: getattr(fsdp, key) for key in fsdp.__all__}
        namespace = types.SimpleNamespace(**{**public, "fully_shard": fully_shard})
        declarations = dataclasses.replace(
            TorchFSDP2Adapter.declarations, api={"fsdp2": namespace}
        )
        return type(name, (TorchFSDP2Adapter,), {"name": name, "declarations": declarations})()


    def _recursive(module, original, *args, recurse=True, **kwargs):
        return original(*args, recurse=True, **kwargs)


    def _empty_list(module, original, modules):
        original(modules)  # its argument checks
        return original([])


    def _ignored(module, original, *args, **kwargs):
        return None


    class _NoWait(fsdp.UnshardHandle):
        def wait(self):
            return None


    def _unshard_no_wait(module, original, async_op=False):
        handle = original(async_op=async_op)
        return _NoWait() if async_op else handle


    def _root_auto_reshard(module, original, value, recurse=True):
        """The root's value reset at lazy init, as before torch fixed it."""
        original(value, recurse=recurse)
        module._get_fsdp_state()._auto_reshard_after_forward = True


    RECURSIVE_SYNC = _adapter("recursive-sync", set_requires_gradient_sync=_recursive)
    NO_RESHARD_AFTER_BACKWARD = _adapter(
        "ignores-reshard-after-backward", set_reshard_after_backward=_ignored
    )
    STUCK_IN_BACKWARD = _adapter("stuck-in-backward")
    DROPS_PARTIAL_SUM = _adapter("drops-partial-sum")
    NO_DIVIDE_FACTOR = _adapter("ignores-divide-factor", set_gradient_divide_factor=_ignored)
    NO_CUSTOM_REDUCE_SCATTER = _adapter(
        "ignores-custom-reduce-scatter", set_custom_reduce_scatter=_ignored
    )
    SEPARATE_GROUP_RECURSES = _adapter(
        "separate-group-recurses", set_separate_reduce_scatter_group=_recursive
    )
    UNUSED_RECURSES = _adapter("unused-params-recurse", set_reduce_scatter_unused_params=_recursive)
    WAIT_DOES_NOTHING = _adapter("wait-does-nothing", unshard=_unshard_no_wait)
    ROOT_AUTO_RESHARD = _adapter("root-auto-reshard", set_reshard_after_forward=_root_auto_reshard)
    UNSHARDS_IN_BACKWARD = _adapter("unshards-in-backward", set_unshard_in_backward=_ignored)
    RESET_DOES_NOTHING = _adapter("reset-does-nothing", reset_iter_state=_ignored)
    STALE_PREFETCH = _adapter("stale-mistargeted-prefetch")
    NO_FORWARD_PREFETCH = _adapter(
        "ignores-forward-prefetch", set_modules_to_forward_prefetch=_empty_list
    )
    NO_CUSTOM_ALL_GATHER = _adapter("ignores-custom-all-gather", set_custom_all_gather=_ignored)

    _final_callback = FSDPState._root_post_backward_final_callback
    _post_backward = FSDPParamGroup.post_backward
    _finalize_backward = FSDPParamGroup.finalize_backward


    def _broken_final_callback(self):
        """stuck-in-backward: after a backward that is not the last, states stay in
        PRE_BACKWARD (torch before pytorch#123857)."""
        last = self._state_ctx.is_last_backward
        _final_callback(self)
        if not last and _marked(self._modules[0], "stuck-in-backward"):
            for state in self._state_ctx.all_states:
                state._training_state = TrainingState.PRE_BACKWARD


    def _broken_post_backward(self, *args):
        """drops-partial-sum: the all-reducing micro-batch forgets the reduce-scattered sums of
        the micro-batches before it."""
        if self.all_reduce_grads and _marked(self.modules[0], "drops-partial-sum"):
            self._partial_reduce_output = None
        return _post_backward(self, *args)


    def _broken_finalize_backward(self):
        """stale-mistargeted-prefetch: a prefetch never waited for survives the backward."""
        if _marked(self.modules[0], "stale-mistargeted-prefetch"):
            result, self._all_gather_result = self._all_gather_result, None
            _finalize_backward(self)
            self._all_gather_result = result
            return
        _finalize_backward(self)


    FSDPState._root_post_backward_final_callback = _broken_final_callback
    FSDPParamGroup.post_backward = _broken_post_backward
    FSDPParamGroup.finalize_backward = _broken_finalize_backward


    def _case(attr):
        @pytest.fixture
        def fsdp_impl(self):
            return f"test_broken_fsdp2:{attr}"

        return type(f"Test_{attr}", (BaseFSDP2ModuleTests,), {"fsdp_impl": fsdp_impl})


    for _attr in [name for name in dir() if name.isupper() and name != "MARK"]:
        globals()[f"Test_{_attr}"] = _case(_attr)
    '''
)

# test -> the line its failure must show
CASES = {
    "RECURSIVE_SYNC::test_gradient_sync_per_module[no_offload]": (
        "*step 0 micro 0 backward: 0 reduce_scatter collective(s), the methods called promise "
        "1 to 3*"
    ),
    "NO_RESHARD_AFTER_BACKWARD::test_gradient_sync_per_module[no_offload]": (
        "*step 0 micro 0, after backward: parameters not where the methods called promise*"
    ),
    "STUCK_IN_BACKWARD::test_gradient_sync_per_module[no_offload]": (
        "*step 0 micro 1 backward: 0 reduce_scatter collective(s)*"
    ),
    "DROPS_PARTIAL_SUM::test_hsdp_all_reduce": (
        "*step 0 micro 2 backward: the gradient of * differs from the reference's*"
    ),
    "NO_DIVIDE_FACTOR::test_reduction": "*the gradient of 'blocks.0.0.weight' (unit 'blocks.0')*",
    "NO_CUSTOM_REDUCE_SCATTER::test_reduction": "*the custom collective of head ran 0 time(s)*",
    "SEPARATE_GROUP_RECURSES::test_reduction": (
        "*step 1 micro 0 backward: * reduce-scatter(s) on a group other than the all-gather*"
    ),
    "UNUSED_RECURSES::test_reduction": "*'branch.weight' of unit 'branch' has a gradient*",
    "WAIT_DOES_NOTHING::test_unshard_reshard": (
        "*after unshard(async_op=True) and wait(): the parameters of blocks.1 are sharded*"
    ),
    "ROOT_AUTO_RESHARD::test_unshard_reshard": "*step 0 micro 0: parameters not where*",
    "UNSHARDS_IN_BACKWARD::test_unshard_reshard": (
        "*step 0 micro 0 backward: 1 all_gather collective(s), the methods called promise 0 to 0*"
    ),
    "RESET_DOES_NOTHING::test_unshard_reshard": (
        "*after reset_iter_state() following a failed forward: parameters not where*"
    ),
    "STALE_PREFETCH::test_prefetch": "*step 1 micro 0: loss * differs from the reference's*",
    "NO_FORWARD_PREFETCH::test_prefetch": (
        "*step 0 micro 0 forward: the prefetch list * promises their all-gathers in that order*"
    ),
    "NO_CUSTOM_ALL_GATHER::test_prefetch": "*all-gather(s) issued outside the custom all-gathers*",
}


def test_each_fsdp2_module_check_fails_on_its_broken_variant(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_broken_fsdp2=BROKEN)
    selected = [f"test_broken_fsdp2.py::Test_{case}" for case in CASES]
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rf", "-n", "0", *selected)
    result.assert_outcomes(failed=len(CASES))
    for case, line in CASES.items():
        header = "*_ Test_" + case.replace("::", ".").replace("[", "[[]") + " _*"
        result.stdout.fnmatch_lines([header, line], consecutive=False)
