"""Each suite check fails, with a useful message, on an FSDP broken in the way it checks.

One pytest run (in a subprocess, through pytester) of a small test file that defines the broken
adapters and subclasses the suite's base classes, one class per broken variant, each pointing
its `fsdp_impl` fixture at its adapter (``"test_broken:ATTR"``).
"""

from __future__ import annotations

import textwrap

import pytest

pytest_plugins = ["pytester"]

BROKEN = textwrap.dedent(
    '''
    from __future__ import annotations

    import pytest
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    from torch.distributed.fsdp._flat_param import HandleTrainingState

    from fsdp_conformance.adapters import InstanceState
    from fsdp_conformance.adapters.impl import ImplAdapter
    from fsdp_conformance.adapters.torch_fsdp1 import TorchFSDP1Adapter
    from fsdp_conformance.suite import (
        BaseDDPParityTests,
        BaseStateDictTests,
        BaseSummonFullParamsTests,
        BaseTrainingStateTests,
    )


    class SumsGradients(TorchFSDP1Adapter):
        """torch FSDP1 whose reduced gradients are summed, not averaged over the ranks."""

        name = "sums-gradients"

        def _wrap(self, module, process_group, config):
            wrapped = super()._wrap(module, process_group, config)
            for instance in FSDP1.fsdp_modules(wrapped):
                instance._gradient_predivide_factor = 1.0
                instance._gradient_postdivide_factor = 1.0
            return wrapped


    class LeavesBackwardPost(TorchFSDP1Adapter):
        """torch FSDP1 that leaves its last instance in BACKWARD_POST after backward."""

        name = "leaves-backward-post"

        def _wrap(self, module, process_group, config):
            wrapped = super()._wrap(module, process_group, config)
            wrapped.register_forward_hook(_after_backward(_leave_last_in_backward_post))
            return wrapped


    def _leave_last_in_backward_post(root):
        if root._is_root:
            FSDP1.fsdp_modules(root)[-1]._handle._training_state = (
                HandleTrainingState.BACKWARD_POST
            )


    def _after_backward(callback):
        """A forward hook: once backward reaches the output, queue callback(module) to run
        at the end of backward (after the implementation's own end-of-backward callback)."""

        def forward_hook(module, args, output):
            if output.requires_grad:
                output.register_hook(lambda grad: torch.autograd.Variable._execution_engine
                                     .queue_callback(lambda: callback(module)))

        return forward_hook


    class ReportsOnlyIdle(ImplAdapter):
        """impl whose adapter maps every instance state to IDLE."""

        name = "reports-only-idle"

        def training_state(self, instance):
            return InstanceState.IDLE


    class SummonAlwaysWritesBack(ImplAdapter):
        """impl whose summon_full_params writes back even when asked not to."""

        name = "summon-always-writes-back"

        def _summon_full_params(self, model, writeback):
            return model.summon_full_params(writeback=True)


    class AssertStateNeverRaises(TorchFSDP1Adapter):
        """torch FSDP1 whose state assertion never fails."""

        name = "assert-state-never-raises"

        def _assert_state(self, instance, states):
            pass


    class IgnoresLoadStateDict(ImplAdapter):
        """impl whose root ignores load_state_dict."""

        name = "ignores-load-state-dict"

        def _wrap(self, module, process_group, config):
            wrapped = super()._wrap(module, process_group, config)
            wrapped.load_state_dict = lambda state_dict, strict=True, assign=False: None
            return wrapped


    class TestSumsGradients(BaseDDPParityTests):
        @pytest.fixture
        def fsdp_impl(self):
            return "test_broken:SumsGradients"


    class TestLeavesBackwardPost(BaseTrainingStateTests):
        @pytest.fixture
        def fsdp_impl(self):
            return "test_broken:LeavesBackwardPost"


    class TestReportsOnlyIdle(BaseTrainingStateTests):
        @pytest.fixture
        def fsdp_impl(self):
            return "test_broken:ReportsOnlyIdle"


    class TestAssertStateNeverRaises(BaseTrainingStateTests):
        @pytest.fixture
        def fsdp_impl(self):
            return "test_broken:AssertStateNeverRaises"


    class TestSummonAlwaysWritesBack(BaseSummonFullParamsTests):
        @pytest.fixture
        def fsdp_impl(self):
            return "test_broken:SummonAlwaysWritesBack"


    class TestIgnoresLoadStateDict(BaseStateDictTests):
        @pytest.fixture
        def fsdp_impl(self):
            return "test_broken:IgnoresLoadStateDict"
    '''
)

DEFAULT_CASE = "nested-ws2-FULL_SHARD-bwd=BACKWARD_PRE-fwd=0-limit=default-offload=0-init=after"
STATE_CASE = "nested-ws2-FULL_SHARD-bwd=BACKWARD_PRE"
SELECTED = [
    f"test_broken.py::TestSumsGradients::test_matches_ddp[{DEFAULT_CASE}]",
    f"test_broken.py::TestLeavesBackwardPost::test_states_are_legal_at_every_hook[{STATE_CASE}]",
    f"test_broken.py::TestReportsOnlyIdle::test_states_are_legal_at_every_hook[{STATE_CASE}]",
    "test_broken.py::TestAssertStateNeverRaises::test_assert_state",
    "test_broken.py::TestSummonAlwaysWritesBack::test_summon_full_params[nested-no_writeback]",
    "test_broken.py::TestIgnoresLoadStateDict::test_state_dict_round_trip[nested]",
    "test_broken.py::TestIgnoresLoadStateDict::test_default_state_dict_round_trip[nested]",
]


def test_each_check_fails_on_its_broken_adapter(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_broken=BROKEN)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-rf", "--fsdp-mode=thread", *SELECTED
    )
    result.assert_outcomes(failed=len(SELECTED))
    result.stdout.fnmatch_lines(
        [
            "*adapter 'sums-gradients'*differs from DDP's gradient there*",
            "*IllegalTrainingState*(adapter 'leaves-backward-post')*",
            "*adapter 'reports-only-idle'*was only ever seen in ?'IDLE'?*",
            "*adapter 'assert-state-never-raises'*asserting IDLE in forward did not raise*",
            "*adapter 'summon-always-writes-back'*changed the sharded parameters*",
            "*adapter 'ignores-load-state-dict'*(the implementation's own)*restored nothing*",
            "*adapter 'ignores-load-state-dict'*default state_dict()*restored nothing*",
        ],
        consecutive=False,
    )
    # each failure names the adapter, the config or instance, and what is wrong
    result.stdout.fnmatch_lines(
        [
            (
                "*rank 0 of 2 failed: *: adapter 'sums-gradients', nested at world size 2"
                " with sharding_strategy='FULL_SHARD', backward_prefetch='BACKWARD_PRE', "
                "forward_prefetch=False, limit_all_gathers=None, cpu_offload=False, "
                "device_init='after': after step 0's backward, this rank's gradient shard of "
                "'module.*' (elements *) differs from DDP's gradient there (bit-exact): "
                "max |difference|*"
            ),
        ],
        consecutive=False,
    )
    result.stdout.fnmatch_lines(
        [
            (
                "*IllegalTrainingState: * illegal training states seen by TrainingStateRecorder "
                "(adapter 'leaves-backward-post')*"
            ),
            (
                "  instance 'module.2' at after optimizer.step: instance state "
                "BACKWARD_POST; allowed: IDLE"
            ),
        ]
    )
    result.stdout.fnmatch_lines(
        [
            (
                "*: adapter 'reports-only-idle', nested at world size 2 with "
                "sharding_strategy='FULL_SHARD', backward_prefetch='BACKWARD_PRE': instance "
                "'<root>' was only ever seen in ?'IDLE'?; it must report FORWARD in its forward "
                "and BACKWARD_PRE/BACKWARD_POST in its backward"
            ),
            (
                "*: adapter 'assert-state-never-raises': _assert_state on the root: "
                "asserting IDLE in forward did not raise, but the root is not in that state"
            ),
            (
                "*: adapter 'summon-always-writes-back', nested: "
                "summon_full_params(writeback=False) changed the sharded parameters *"
            ),
            (
                "*: adapter 'ignores-load-state-dict', nested, the adapter's "
                "state_dict / load_state_dict (the implementation's own): after loading the state "
                "saved at step 1, full parameter 'module.0.weight' differs from the saved one by "
                "*; the load restored nothing*"
            ),
            (
                "*: adapter 'ignores-load-state-dict', nested, the wrapped module's "
                "default state_dict() / load_state_dict(): after loading the state saved at step "
                "1, full parameter 'module.0.weight' differs from the saved one by *"
            ),
        ],
        consecutive=False,
    )
