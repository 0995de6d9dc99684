"""The ``state_dict.full`` and ``init.meta`` checks against the built-in adapters, and each
failing on an implementation broken the way it checks.

The built-in run overrides ``fsdp_impl`` per class: impl runs every cell; torch FSDP1 and FSDP2
run the cells where they differ from impl (options, ``assign``, the subgroup, both wrappings of
meta init) -- ``fsdp-conformance run --impl NAME`` runs them all. The broken variants run in
pytester subprocesses: impl with its state dict or materialisation broken, torch FSDP2 whose
state dict copies the shards instead of viewing them, torch FSDP1 whose DCP optimizer-state
calls drop the model's group (what torch 2.8.0 does: the subgroup cell hangs until its timeout).
"""

from __future__ import annotations

import textwrap

import pytest

from fsdp_conformance.suite import BaseFullStateDictTests, BaseMetaInitTests

pytest_plugins = ["pytester"]


@pytest.fixture(params=("impl", "torch-fsdp1", "torch-fsdp2"))
def _adapter(request: pytest.FixtureRequest) -> str:
    return request.param


class TestFullStateDictImpl(BaseFullStateDictTests):
    @pytest.fixture
    def fsdp_impl(self) -> str:
        return "impl"


class TestMetaInit(BaseMetaInitTests):
    @pytest.fixture
    def fsdp_impl(self, _adapter: str) -> str:
        return _adapter


class TestFullStateDictTorch(BaseFullStateDictTests):
    options = ("default", "offload_to_cpu")
    loads = ("assign",)

    @pytest.fixture(params=("torch-fsdp1", "torch-fsdp2"))
    def fsdp_impl(self, request: pytest.FixtureRequest) -> str:
        return request.param


BROKEN = textwrap.dedent(
    '''
    from __future__ import annotations

    import contextlib

    import pytest
    import torch

    from fsdp_conformance.adapters.impl import ImplAdapter
    from fsdp_conformance.adapters.torch_fsdp1 import TorchFSDP1Adapter
    from fsdp_conformance.adapters.torch_fsdp2 import TorchFSDP2Adapter
    from fsdp_conformance.impl import fully_sharded, state_dict
    from fsdp_conformance.suite import BaseFullStateDictTests, BaseMetaInitTests


    def _flagged(module, flag):
        return module.__dict__.get(flag, False)


    class _Flagging:
        """Marks every instance it wraps with `flag` (the broken functions below check it)."""

        flag = ""

        def _wrap(self, module, process_group, config):
            wrapped = super()._wrap(module, process_group, config)
            wrapped.__dict__[self.flag] = True
            return wrapped


    class KeepsPrefixes(_Flagging, ImplAdapter):
        """impl whose full state dict keeps the wrapper's segment in nested keys."""

        name, flag = "keeps-prefixes", "_mutant_prefixes"


    class DropsBuffers(_Flagging, ImplAdapter):
        """impl whose full state dict leaves out the persistent buffers."""

        name, flag = "drops-buffers", "_mutant_drops_buffers"


    class CastBuffers(_Flagging, ImplAdapter):
        """impl whose state dict returns mixed-precision buffers in their cast dtype."""

        name, flag = "cast-buffers", "_mutant_cast_buffers"


    class MixesBuffers(_Flagging, ImplAdapter):
        """impl whose state dict gives each of a module's buffers its last buffer's value (the
        loop-variable mix-up of pytorch/pytorch#93391)."""

        name, flag = "mixes-buffers", "_mutant_mixes_buffers"


    class AssignLoadsNothing(_Flagging, ImplAdapter):
        """impl whose load_state_dict(assign=True) returns without loading."""

        name, flag = "assign-loads-nothing", "_mutant_assign"


    class _WhileWrapping(ImplAdapter):
        """Switches its `mode` on while impl builds its instances (materialisation happens in
        impl's constructor, before any flag could be set on the instance)."""

        mode = ""

        def _wrap(self, module, process_group, config):
            MODES.add(self.mode)
            try:
                return super()._wrap(module, process_group, config)
            finally:
                MODES.discard(self.mode)


    class InitialisesTwice(_WhileWrapping):
        """impl whose root materialisation re-initialises its nested instances' modules too."""

        name, mode = "initialises-twice", "twice"


    class LeavesBuffersOnMeta(_WhileWrapping):
        """impl that materialises only the modules holding parameters (a buffer-only module
        stays on the meta device)."""

        name, mode = "leaves-buffers-on-meta", "meta_buffers"


    class CopiesShards(TorchFSDP2Adapter):
        """torch FSDP2 whose state dict holds copies of the shards, not views."""

        name = "copies-shards"

        def _wrap(self, module, process_group, config):
            wrapped = super()._wrap(module, process_group, config)
            wrapped.__dict__["_mutant_copies"] = True
            return wrapped


    class DropsDCPGroup(TorchFSDP1Adapter):
        """torch FSDP1 whose optim_state_dict(_to_load) ignore the group DCP hands them (torch
        2.8.0's get_state_dict / set_state_dict pass none)."""

        name = "drops-dcp-group"

        def save_checkpoint(self, model, optimizer, directory):
            with _without_group():
                super().save_checkpoint(model, optimizer, directory)

        def load_checkpoint(self, model, optimizer, directory):
            with _without_group():
                super().load_checkpoint(model, optimizer, directory)


    _state_dict = state_dict.StateDictMixin.state_dict
    _value = state_dict.StateDictMixin._value
    _load = state_dict.StateDictMixin.load_state_dict
    _materialize = fully_sharded._materialize_meta


    def _broken_state_dict(self, *args, **kwargs):
        result = _state_dict(self, *args, **kwargs)
        if _flagged(self, "_mutant_prefixes"):
            return {key.replace("blocks.0.", "blocks.0._fsdp_wrapped_module."): value
                    for key, value in result.items()}
        if _flagged(self, "_mutant_drops_buffers"):
            return {key: value for key, value in result.items() if "shift" not in key}
        return result


    def _broken_value(self, entry):
        if _flagged(self, "_mutant_cast_buffers") and entry.kind == "buffer":
            return entry.module._buffers[entry.attr].detach().clone()
        if _flagged(self, "_mutant_mixes_buffers") and entry.kind == "buffer":
            last = list(entry.module._buffers)[-1]
            return _value(self, entry._replace(attr=last))
        return _value(self, entry)


    def _broken_load(self, state_dict, strict=True, assign=False):
        if assign and _flagged(self, "_mutant_assign"):
            return None
        return _load(self, state_dict, strict, assign)


    def _broken_materialize(module, ignored, device_id, param_init_fn):
        if "meta_buffers" in MODES:

            def param_init_fn(sub):
                if any(True for _ in sub.parameters(recurse=False)):
                    sub.to_empty(device=torch.device("cpu"), recurse=False)
                    sub.reset_parameters()

        _materialize(module, ignored, device_id, param_init_fn)
        if "twice" in MODES:
            for inner in fully_sharded.FullyShardedDataParallel.fsdp_modules(module):
                with torch.no_grad(), inner.summon_full_params(writeback=True):
                    for sub in inner.module.modules():
                        if hasattr(sub, "reset_parameters"):
                            sub.reset_parameters()


    def _without_group():
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        from unittest import mock

        def drop(original):
            return staticmethod(lambda *args, group=None, **kwargs: original(*args, **kwargs))

        stack = contextlib.ExitStack()
        for name in ("optim_state_dict", "optim_state_dict_to_load"):
            stack.enter_context(mock.patch.object(FSDP, name, drop(getattr(FSDP, name))))
        return stack


    _save = torch.nn.Module._save_to_state_dict


    def _broken_save(self, destination, prefix, keep_vars):
        _save(self, destination, prefix, keep_vars)
        if _flagged(self, "_mutant_copies"):
            for name in self._parameters:
                key = prefix + name
                if hasattr(destination.get(key), "device_mesh"):
                    destination[key] = destination[key].clone()


    MODES = set()
    state_dict.StateDictMixin.state_dict = _broken_state_dict
    state_dict.StateDictMixin._value = _broken_value
    state_dict.StateDictMixin.load_state_dict = _broken_load
    fully_sharded._materialize_meta = _broken_materialize
    torch.nn.Module._save_to_state_dict = _broken_save


    def _impl(attr):
        @pytest.fixture
        def fsdp_impl(self):
            return f"test_broken_state_dict:{attr}"

        return fsdp_impl


    class TestKeepsPrefixes(BaseFullStateDictTests):
        fsdp_impl = _impl("KeepsPrefixes")


    class TestDropsBuffers(BaseFullStateDictTests):
        fsdp_impl = _impl("DropsBuffers")


    class TestCastBuffers(BaseFullStateDictTests):
        fsdp_impl = _impl("CastBuffers")


    class TestMixesBuffers(BaseFullStateDictTests):
        fsdp_impl = _impl("MixesBuffers")


    class TestAssignLoadsNothing(BaseFullStateDictTests):
        fsdp_impl = _impl("AssignLoadsNothing")


    class TestCopiesShards(BaseFullStateDictTests):
        fsdp_impl = _impl("CopiesShards")


    class TestDropsDCPGroup(BaseFullStateDictTests):
        fsdp_impl = _impl("DropsDCPGroup")


    class TestInitialisesTwice(BaseMetaInitTests):
        fsdp_impl = _impl("InitialisesTwice")


    class TestLeavesBuffersOnMeta(BaseMetaInitTests):
        fsdp_impl = _impl("LeavesBuffersOnMeta")
    '''
)

# (selected tests, the lines the run must show), one subprocess each (-n spreads them)
GROUPS = {
    "state-dict": (
        [
            "TestKeepsPrefixes::test_full_state_dict[default]",
            "TestDropsBuffers::test_full_state_dict[rank0_only]",
            "TestCastBuffers::test_mixed_precision_buffers",
            "TestMixesBuffers::test_full_state_dict[offload_to_cpu]",
            "TestAssignLoadsNothing::test_load_plain_state_dict[assign]",
            "TestCopiesShards::test_full_state_dict[default]",
        ],
        [
            # (fnmatch: no brackets, they would be a character class)
            (
                "*adapter 'keeps-prefixes', buffered, full state dict (default): keys differ from the "
                "plain module's state_dict(): missing *'blocks.0.affine.shift'*unexpected "
                "*'blocks.0._fsdp_wrapped_module.affine.shift'*"
            ),
            (
                "*adapter 'drops-buffers', buffered, full state dict (rank0_only): keys differ from "
                "the plain module's state_dict(): missing *'blocks.0.affine.shift', "
                "'blocks.1.affine.shift'*"
            ),
            (
                "*adapter 'cast-buffers', buffered, full state dict under fp16 buffers: "
                "'blocks.0.affine.shift' is torch.float16 (15,), the plain module's is "
                "torch.float32 (15,)*"
            ),
            (
                "*adapter 'mixes-buffers', buffered, full state dict (offload_to_cpu): "
                "'blocks.0.affine.shift' differs from DDP's by *"
            ),
            (
                "*adapter 'assign-loads-nothing', buffered, a plain state dict loaded (assign): "
                "losses differ from DDP's*"
            ),
            (
                "*adapter 'copies-shards', buffered, full state dict (default): 'head.weight' of the "
                "state dict taken before training (a DTensor, documented as a view of the shards) "
                "differs from the trained value*"
            ),
        ],
    ),
    "meta-init": (
        [
            "TestInitialisesTwice::test_meta_init[nested]",
            "TestLeavesBuffersOnMeta::test_meta_init[auto_wrap]",
        ],
        [
            (
                "*adapter 'initialises-twice', buffered_meta (nested): after materialisation these "
                "differ from the model built on the CPU (max |difference|): {'blocks.0.lin.weight'*"
            ),
            (
                "*adapter 'leaves-buffers-on-meta', buffered_meta (auto_wrap): still on the meta "
                "device after materialize: *affine.scale*"
            ),
        ],
    ),
    "subgroup": (
        ["TestDropsDCPGroup::test_on_a_subgroup[first]"],
        # the harness names the collective on the world group that rank 1 never enters
        ["*rank 0 of 2 hung: waiting in *never entered by the others*"],
    ),
}


@pytest.mark.parametrize(
    "groups", [("state-dict", "meta-init"), ("subgroup",)], ids=["state-dict-meta-init", "subgroup"]
)
def test_each_check_fails_on_its_broken_variant(
    pytester: pytest.Pytester, groups: tuple[str, ...]
) -> None:
    tests = [test for group in groups for test in GROUPS[group][0]]
    pytester.makepyfile(test_broken_state_dict=BROKEN)
    selected = [f"test_broken_state_dict.py::{test}" for test in tests]
    # thread mode: a failing cell does not restart rank processes; the subgroup group checks
    # the message of a process-mode hang
    mode = "process" if "subgroup" in groups else "thread"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-rf", "-n", "0", f"--fsdp-mode={mode}", *selected
    )
    result.assert_outcomes(failed=len(tests))
    for group in groups:  # one pytest run (one rank set); each group's lines in their order
        result.stdout.fnmatch_lines(GROUPS[group][1], consecutive=False)


def test_an_override_without_the_options_still_runs_and_names_what_to_extend() -> None:
    """An outside adapter's ``state_dict(self, model)``, written before the options existed:
    called without options as before; an option makes the cell not applicable, naming it."""
    from fsdp_conformance.adapters import UnsupportedFeatureError
    from fsdp_conformance.adapters.base import claimed_but_not_implemented
    from fsdp_conformance.adapters.impl import ImplAdapter
    from fsdp_conformance.suite.test_state_dict import call_with_options

    class Legacy(ImplAdapter):
        name = "legacy"

        def state_dict(self, model):  # type: ignore[override]
            return {"model": model}

    adapter = Legacy()
    assert call_with_options(adapter, "state_dict", "m", rank0_only=False) == {"model": "m"}
    with pytest.raises(
        UnsupportedFeatureError,
        match=r"adapter 'legacy' does not support 'full_state_dict': Legacy\.state_dict takes no "
        r"keyword rank0_only; extend that override of Adapter\.state_dict",
    ) as raised:
        call_with_options(adapter, "state_dict", "m", rank0_only=True)
    # an override exists: not applicable, not "claimed but never implemented" (a FAIL)
    assert claimed_but_not_implemented(adapter, raised.value) is None
