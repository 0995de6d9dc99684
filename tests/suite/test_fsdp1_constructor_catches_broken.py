"""Each check of the FSDP1 API family's constructor and config (suite/test_fsdp1_constructor.py)
fails on a torch FSDP1 broken in the way it checks, and passes on torch FSDP1 itself.

One pytest run (a subprocess, through pytester) of a test file with one suite class per broken
variant; its test runs the suite's with torch FSDP1's internals monkeypatched inside the rank
(undone after it), broken the way a real bug did:

- CustomPolicy dropping its per-module kwargs; ModuleWrapPolicy forgetting a selected module;
- keep_low_precision_grads not reaching the handles (gradients upcast after all);
- _module_classes_to_ignore not applied (LayerNorm in bfloat16);
- the root casting its inputs despite cast_root_forward_inputs=False;
- param_init_fn's traversal visiting every module twice (each initialised twice);
- auto-wrapping that forgets the ignored modules (the ignored block gets an instance);
- an int device_id taken for the CPU; a 2-D mesh's dimensions swapped (shard across replicas);
- use_orig_params losing requires_grad=False; fsdp_modules(root_only=True) listing every
  instance; apply() gathering without writeback.
"""

from __future__ import annotations

import textwrap

import pytest

pytest_plugins = ["pytester"]

BROKEN = textwrap.dedent(
    """
    from __future__ import annotations

    import functools

    import pytest
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp._common_utils import TrainingState
    from torch.distributed.fsdp import (
        _flat_param,
        _init_utils,
        _runtime_utils,
        _traversal_utils,
        _wrap_utils,
        fully_sharded_data_parallel,
        wrap,
    )

    from fsdp_conformance.suite import BaseFSDP1ConstructorTests


    def drop_custom_kwargs(monkeypatch):
        custom = wrap.CustomPolicy._run_policy
        by_class = wrap.ModuleWrapPolicy._run_policy

        def root_kwargs_only(self, root, ignored, kwargs):
            return {module: dict(kwargs) for module in custom(self, root, ignored, kwargs)}

        def first_forgotten(self, root, ignored, kwargs):
            return dict(list(by_class(self, root, ignored, kwargs).items())[1:])

        monkeypatch.setattr(wrap.CustomPolicy, "_run_policy", root_kwargs_only)
        monkeypatch.setattr(wrap.ModuleWrapPolicy, "_run_policy", first_forgotten)


    def drop_keep_low_precision_grads(monkeypatch):
        init = _flat_param.FlatParamHandle.__init__

        def handle_init(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self._keep_low_precision_grads = False

        monkeypatch.setattr(_flat_param.FlatParamHandle, "__init__", handle_init)


    def ignore_module_classes(monkeypatch):
        monkeypatch.setattr(_wrap_utils, "_override_module_mixed_precision", lambda *a, **k: set())
        monkeypatch.setattr(
            _wrap_utils, "_run_mixed_precision_override_policy", lambda *args: args[-1]
        )


    def root_always_casts(monkeypatch):
        def cast(state, module, args, kwargs):
            dtype = state.mixed_precision.param_dtype
            return _runtime_utils._cast_forward_inputs(dtype, *args, **kwargs)

        monkeypatch.setattr(_runtime_utils, "_root_cast_forward_input", cast)


    def materialize_twice(monkeypatch):
        modules = _init_utils._get_modules_to_materialize
        monkeypatch.setattr(
            _init_utils, "_get_modules_to_materialize", lambda *args: modules(*args) * 2
        )


    def auto_wrap_forgets_ignored(monkeypatch):
        recursive = _wrap_utils._recursive_wrap

        def forgetting(**kwargs):
            return recursive(**{**kwargs, "ignored_modules": set(), "ignored_params": set()})

        monkeypatch.setattr(_wrap_utils, "_recursive_wrap", forgetting)


    def int_device_is_cpu(monkeypatch):
        handle = fully_sharded_data_parallel._init_device_handle
        device_of = _init_utils._get_device_from_device_id

        def cpu(device_id):
            return torch.device("cpu") if isinstance(device_id, int) else device_id

        def init_device_handle(state, module, ignored_params, device_id):
            return handle(state, module, ignored_params, cpu(device_id))

        def get_device(device_id, rank, device_handle):
            return device_of(cpu(device_id), rank, device_handle)

        monkeypatch.setattr(fully_sharded_data_parallel, "_init_device_handle", init_device_handle)
        monkeypatch.setattr(_init_utils, "_get_device_from_device_id", get_device)


    def swap_mesh_dims(monkeypatch):
        hybrid = _init_utils._init_process_group_state_for_hybrid_shard

        def swapped(state, process_group, device_mesh):
            state = hybrid(state, process_group, device_mesh)
            if device_mesh is not None:
                state.process_group, state._inter_node_pg = state._inter_node_pg, state.process_group
                state._inter_node_state = _init_utils._get_default_comm_hook_state(
                    process_group=state._inter_node_pg
                )
            return state

        monkeypatch.setattr(_init_utils, "_init_process_group_state_for_hybrid_shard", swapped)


    def orig_params_all_trainable(monkeypatch):
        sharded = _flat_param.FlatParamHandle._use_sharded_views

        def views(self):
            sharded(self)
            for param in self.flat_param._params or ():
                param.requires_grad_(True)

        monkeypatch.setattr(_flat_param.FlatParamHandle, "_use_sharded_views", views)


    def root_only_lists_all(monkeypatch):
        monkeypatch.setattr(
            fully_sharded_data_parallel, "_get_fsdp_root_states", _traversal_utils._get_fsdp_states
        )


    def apply_without_writeback(monkeypatch):
        def apply(self, fn):
            if self.training_state != TrainingState.IDLE:  # a nested instance, inside the root's
                return torch.nn.Module.apply(self, fn)
            with FSDP.summon_full_params(self, writeback=False):
                return torch.nn.Module.apply(self, fn)

        monkeypatch.setattr(FSDP, "apply", apply)


    def broken(patch, *tests):
        # a suite class whose `tests` run with torch broken by `patch` inside the rank
        namespace = {"fsdp_impl": pytest.fixture(lambda self: "torch-fsdp1")}
        for name in tests:
            test = getattr(BaseFSDP1ConstructorTests, name)

            @functools.wraps(test)
            def run_broken(*args, test=test, **kwargs):
                with pytest.MonkeyPatch.context() as monkeypatch:
                    patch(monkeypatch)
                    return test(*args, **kwargs)

            namespace[name] = run_broken
        return type(patch.__name__, (BaseFSDP1ConstructorTests,), namespace)


    class TestTorchFSDP1(BaseFSDP1ConstructorTests):
        @pytest.fixture
        def fsdp_impl(self):
            return "torch-fsdp1"


    TestCustomKwargsDropped = broken(drop_custom_kwargs, "test_auto_wrap_policy")
    TestKeepLowPrecisionGradsDropped = broken(drop_keep_low_precision_grads, "test_keep_low_precision_grads")
    TestModuleClassesNotIgnored = broken(ignore_module_classes, "test_module_classes_to_ignore")
    TestRootAlwaysCasts = broken(root_always_casts, "test_cast_forward_inputs")
    TestInitTwice = broken(materialize_twice, "test_param_init_fn")
    TestIgnoredModulesWrapped = broken(auto_wrap_forgets_ignored, "test_ignored_modules")
    TestIntDeviceIsCpu = broken(int_device_is_cpu, "test_device_id")
    TestMeshDimsSwapped = broken(swap_mesh_dims, "test_device_mesh")
    TestOrigParamsAllTrainable = broken(orig_params_all_trainable, "test_use_orig_params")
    TestRootOnlyListsAll = broken(root_only_lists_all, "test_module_api")
    TestApplyWithoutWriteback = broken(apply_without_writeback, "test_apply")
    """
)

# broken class -> (its tests, lines of their failures; "?" stands for a bracket)
CASES = {
    "TestCustomKwargsDropped": (
        ["test_auto_wrap_policy[custom]", "test_auto_wrap_policy[module_wrap]"],
        [
            (
                "*auto_wrap_policy custom: blocks holding all their elements: ??, expected ?1?; "
                "head computes in: {'Linear': {'torch.float32'}}, expected*"
            ),
            (
                "*auto_wrap_policy module_wrap: instances around: ?'<root>', 'blocks.0.0', *'head'?, "
                "expected ?'<root>', *'head', 'trunk'?"
            ),
        ],
    ),
    "TestKeepLowPrecisionGradsDropped": (
        ["test_keep_low_precision_grads[FULL_SHARD]", "test_keep_low_precision_grads[NO_SHARD]"],
        [
            f"*keep_low_precision_grads=True), {strategy}, use_orig_params=*: gradients: "
            "{'torch.float32'}, expected {'torch.bfloat16'}"
            for strategy in ("FULL_SHARD", "NO_SHARD")
        ],
    ),
    "TestModuleClassesNotIgnored": (
        ["test_module_classes_to_ignore[callable]", "test_module_classes_to_ignore[module_wrap]"],
        [
            f"*auto_wrap_policy {policy}: LayerNorm: {{'torch.bfloat16'}}, expected "
            "{'torch.float32'}"
            for policy in ("callable", "module_wrap")
        ],
    ),
    "TestRootAlwaysCasts": (
        ["test_cast_forward_inputs"],
        ["*cast_forward_inputs=True): root: torch.bfloat16, expected torch.float32"],
    ),
    "TestInitTwice": (
        ["test_param_init_fn"],
        ["*param_init_fn, auto-wrapped: calls: {'blocks.0': 2, *, expected {'trunk': 1, *"],
    ),
    "TestIgnoredModulesWrapped": (
        ["test_ignored_modules[ignored_modules]"],
        ["*ignored_modules=?blocks?1??, auto-wrapped: instances around it: 1, expected 0"],
    ),
    "TestIntDeviceIsCpu": (
        ["test_device_id[int]"],
        ["*device_id int: device_id=0 (an accelerator's index) was accepted on a host without one"],
    ),
    "TestMeshDimsSwapped": (
        ["test_device_mesh[2d]"],
        ["*device_mesh 2d *: all_gather: {(0, 2)}, expected {(0, 1)}; *"],
    ),
    "TestOrigParamsAllTrainable": (
        ["test_use_orig_params"],
        [
            (
                "*use_orig_params=True: named_parameters() (name, requires_grad): ?*"
                "('blocks.0.0.weight', True)*, expected ?*('blocks.0.0.weight', False)*"
            )
        ],
    ),
    "TestRootOnlyListsAll": (
        ["test_module_api"],
        ["*fsdp_modules(root_only=True): ?'<root>', 'blocks.0', *, expected ?'<root>', 'side'?"],
    ),
    "TestApplyWithoutWriteback": (
        ["test_apply"],
        ["*apply(fn) setting every Linear's bias: after 2 steps losses*"],
    ),
}


def test_each_check_fails_on_its_broken_torch_and_passes_on_torch(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_broken_fsdp1=BROKEN)
    failing = [f"{cls}::{test}" for cls, (tests, _) in CASES.items() for test in tests]
    passing = sorted({f"TestTorchFSDP1::{test.split('::')[1]}" for test in failing})
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "-rf",
        "-n",
        "0",
        "--fsdp-mode=process",
        *(f"test_broken_fsdp1.py::{test}" for test in failing + passing),
    )
    result.assert_outcomes(failed=len(failing), passed=len(passing))
    lines = [line for _, patterns in CASES.values() for line in patterns]
    result.stdout.fnmatch_lines(lines, consecutive=False)
