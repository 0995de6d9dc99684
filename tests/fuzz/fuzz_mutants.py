"""Broken variants of the reference FSDP that the fixed zoo does not catch (issue 20), as
adapters: ``--impl fuzz_mutants:DROP_SMALL_GRADS`` (with this directory on sys.path).

Each patches impl in the rank process when it first wraps (the rank sets of these tests are
their own: the CLI and the repro start fresh ranks), so a real code path is broken, not a check.
"""

from __future__ import annotations

from fsdp_conformance.adapters.impl import ImplAdapter

_installed: set[str] = set()


def _drop_small_grads() -> None:
    """Gradients of original parameters with fewer elements than ranks are dropped before the
    reduction (an empty-shard / padding bug): their parameters never train."""
    from fsdp_conformance.impl.flat_param import FlatParamHandle

    original = FlatParamHandle.start_grad_reduction

    def start_grad_reduction(self):
        grad = self.unsharded.grad
        if grad is not None:
            offset = 0
            for numel in self.numels:
                if numel < self.world_size:
                    grad[offset : offset + numel].zero_()
                offset += numel
        return original(self)

    FlatParamHandle.start_grad_reduction = start_grad_reduction


def _second_use_not_unsharded() -> None:
    """An instance called twice in one forward registers its pre-backward hook on the first
    call's outputs only, so the backward of the second use runs on resharded parameters."""
    from fsdp_conformance.impl import runtime

    original_post_forward = runtime.post_forward
    original_finish = runtime.finish_iteration
    hooked: set[int] = set()

    def post_forward(state, output):
        if state.is_root or state.recomputing or id(state) not in hooked:
            hooked.add(id(state))
            return original_post_forward(state, output)
        import torch

        with torch.no_grad():  # no pre-backward hook on this use's outputs
            return original_post_forward(state, output)

    def finish_iteration(root):
        hooked.clear()
        return original_finish(root)

    runtime.post_forward = post_forward
    runtime.finish_iteration = finish_iteration


class _Mutant(ImplAdapter):
    patch = staticmethod(lambda: None)

    def _wrap(self, module, process_group, config):
        if self.name not in _installed:
            _installed.add(self.name)
            self.patch()
        return super()._wrap(module, process_group, config)


class DropSmallGrads(_Mutant):
    name = "impl-drop-small-grads"
    patch = staticmethod(_drop_small_grads)


class SecondUseNotUnsharded(_Mutant):
    name = "impl-second-use-not-unsharded"
    patch = staticmethod(_second_use_not_unsharded)


DROP_SMALL_GRADS = DropSmallGrads()
SECOND_USE_NOT_UNSHARDED = SecondUseNotUnsharded()
