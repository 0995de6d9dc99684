"""Each training-loop check (suite/loops.py) fails on an FSDP broken in the way it checks.

One pytest run (a subprocess, through pytester) of a test file defining broken variants of the
reference FSDP (through its adapter) and one suite class per variant, each pointing its
`fsdp_impl` fixture at its adapter (``"test_broken_loops:ATTR"``); one case per check.
"""

from __future__ import annotations

import textwrap

import pytest

pytest_plugins = ["pytester"]

BROKEN = textwrap.dedent(
    '''
    from __future__ import annotations

    import contextlib

    import pytest
    import torch

    from fsdp_conformance.adapters.impl import ImplAdapter
    from fsdp_conformance.impl import HandleTrainingState, runtime
    from fsdp_conformance.suite import (
        BaseActivationCheckpointingTests,
        BaseCheckpointResumeTests,
        BaseForwardVariantsTests,
        BaseFrozenParameterTests,
        BaseGradientAccumulationTests,
        BaseGradientClippingTests,
    )


    class DropsMicroBatches(ImplAdapter):
        """impl whose no_sync drops the gradients accumulated inside it."""

        name = "drops-micro-batches"

        @contextlib.contextmanager
        def no_sync(self, model):
            with model.no_sync():
                yield
            for instance in self.instances(model):
                handle = instance._fsdp_state.handle
                if handle is not None:
                    handle.unsharded.grad = None


    class IgnoresNoSync(ImplAdapter):
        """impl whose no_sync reduces anyway (the sums still match DDP)."""

        name = "ignores-no-sync"

        def no_sync(self, model):
            return contextlib.nullcontext()


    class LocalNormClipping(ImplAdapter):
        """impl clipping by each rank's local shard norm (no reduction across ranks)."""

        name = "local-norm-clipping"

        def clip_grad_norm_(self, model, max_norm, norm_type=2.0):
            params = [p for p in model.parameters() if p.grad is not None]
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)


    class TrainsFrozen(ImplAdapter):
        """impl that trains parameters marked requires_grad=False."""

        name = "trains-frozen"

        def _wrap(self, module, process_group, config):
            module.requires_grad_(True)
            return super()._wrap(module, process_group, config)


    class RecomputeStaysForward(ImplAdapter):
        """impl whose activation-checkpoint recompute enters FORWARD (impl before this check:
        non-reentrant checkpoint stops the recompute early, its post-forward never runs, and
        the instance goes FORWARD -> BACKWARD_POST)."""

        name = "recompute-stays-forward"

        def _wrap(self, module, process_group, config):
            wrapped = super()._wrap(module, process_group, config)
            wrapped._mutant_recompute_stays_forward = True
            return wrapped


    class KeepsEvalBuffers(ImplAdapter):
        """impl that does not reshard after a forward under torch.no_grad()."""

        name = "keeps-eval-buffers"

        def _wrap(self, module, process_group, config):
            wrapped = super()._wrap(module, process_group, config)
            wrapped._mutant_keeps_eval_buffers = True
            return wrapped


    class LoadsNothing(ImplAdapter):
        """impl whose load_checkpoint silently restores nothing."""

        name = "loads-nothing"

        def load_checkpoint(self, model, optimizer, directory):
            pass


    _pre_forward = runtime.pre_forward
    _reshard = runtime.reshard


    def _broken_pre_forward(state, args, kwargs):
        result = _pre_forward(state, args, kwargs)
        if _flagged(state, "_mutant_recompute_stays_forward") and state.recomputing:
            state.handle_training_state = HandleTrainingState.FORWARD
        return result


    def _flagged(state, flag):
        root = state.context.root if state.context is not None else state
        return root.owner.__dict__.get(flag, False)


    def _broken_reshard(state):
        if _flagged(state, "_mutant_keeps_eval_buffers") and not torch.is_grad_enabled():
            return
        return _reshard(state)


    runtime.pre_forward = _broken_pre_forward
    runtime.reshard = _broken_reshard


    def _impl(attr):
        @pytest.fixture
        def fsdp_impl(self):
            return f"test_broken_loops:{attr}"

        return fsdp_impl


    class TestDropsMicroBatches(BaseGradientAccumulationTests):
        fsdp_impl = _impl("DropsMicroBatches")


    class TestIgnoresNoSync(BaseGradientAccumulationTests):
        fsdp_impl = _impl("IgnoresNoSync")


    class TestLocalNormClipping(BaseGradientClippingTests):
        fsdp_impl = _impl("LocalNormClipping")


    class TestTrainsFrozen(BaseFrozenParameterTests):
        fsdp_impl = _impl("TrainsFrozen")


    class TestRecomputeStaysForward(BaseActivationCheckpointingTests):
        fsdp_impl = _impl("RecomputeStaysForward")


    class TestKeepsEvalBuffers(BaseForwardVariantsTests):
        fsdp_impl = _impl("KeepsEvalBuffers")


    class TestLoadsNothing(BaseCheckpointResumeTests):
        fsdp_impl = _impl("LoadsNothing")
    '''
)

# (selected tests, the lines the run must show), in two subprocesses (-n spreads them)
GROUPS = {
    "accumulation-clipping-frozen": (
        [
            "TestDropsMicroBatches::test_accumulation_matches_ddp[loops-FULL_SHARD-no_sync]",
            "TestIgnoresNoSync::test_no_reduction_while_accumulating[FULL_SHARD]",
            "TestLocalNormClipping::test_clipping_matches_ddp[loops_gains-FULL_SHARD-norm2]",
            "TestTrainsFrozen::test_frozen_parameters[loops_frozen_mixed-FULL_SHARD]",
        ],
        [
            (
                "*: adapter 'drops-micro-batches', loops, FULL_SHARD, 3 micro-batches "
                "per step, no_sync: losses differ from DDP's at step * (bit-exact)*"
            ),
            (
                "*: adapter 'ignores-no-sync', loops, FULL_SHARD: gradient accumulation "
                "broke no_sync's promise:*"
            ),
            "*step 0 micro 0 (inside no_sync): gradient reductions {*",
            (
                "*: adapter 'local-norm-clipping', loops_gains, FULL_SHARD, "
                "norm_type=2.0: total norms returned by clip_grad_norm_ differ from DDP + "
                "torch.nn.utils.clip_grad_norm_*"
            ),
            (
                "*: adapter 'trains-frozen', loops_frozen_mixed, FULL_SHARD: frozen "
                "parameter 'blocks.0.0.weight' (requires_grad=False) changed in training*"
            ),
        ],
    ),
    "recompute-eval-resume": (
        [
            "TestRecomputeStaysForward::test_activation_checkpointing[nested-FULL_SHARD-outside]",
            "TestKeepsEvalBuffers::test_forward_variant[eval_forward-FULL_SHARD]",
            "TestLoadsNothing::test_checkpoint_resume[loops-ws2to1]",
        ],
        [
            (
                "*IllegalTrainingState: * illegal training states seen by TrainingStateRecorder "
                "(adapter 'recompute-stays-forward')*"
            ),
            "*instance state BACKWARD_POST after FORWARD*",
            (
                "*: adapter 'keeps-eval-buffers', loops, FULL_SHARD, eval_forward: after "
                "the evaluation forward under torch.no_grad() these non-root instances still hold "
                "their unsharded parameters*"
            ),
            (
                "*: adapter 'loads-nothing', loops, saved at world size 2, loaded at 1: "
                "right after load_checkpoint, full parameter * differs from the saved one*"
            ),
        ],
    ),
}


@pytest.mark.parametrize("group", list(GROUPS))
def test_each_loop_check_fails_on_its_broken_variant(pytester: pytest.Pytester, group: str) -> None:
    tests, lines = GROUPS[group]
    pytester.makepyfile(test_broken_loops=BROKEN)
    selected = [f"test_broken_loops.py::{test}" for test in tests]
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rf", "-n", "0", *selected)
    result.assert_outcomes(failed=len(tests))
    result.stdout.fnmatch_lines(lines, consecutive=False)
