"""Broken variants of the reference FSDP that the fixed zoo does not catch, as
adapters: ``--impl fuzz_mutants:DROP_SMALL_GRADS`` (with this directory on sys.path).

Each patches impl in the rank process when it first wraps (the rank sets of these tests are
their own: the CLI and the repro start fresh ranks), so a real code path is broken, not a check.
"""

from __future__ import annotations

import dataclasses

from fsdp_conformance.adapters import Feature
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


def _load_skips_nested() -> None:
    """A full ``load_state_dict`` writes only the parameters of the instance it is called on:
    those of nested instances keep their values (after meta-device init: ``reset_parameters``')."""
    from fsdp_conformance.impl.state_dict import StateDictMixin

    original = StateDictMixin.load_state_dict

    def load_state_dict(self, state_dict, strict=True, assign=False):
        handle = self._fsdp_state.handle
        own = {id(slot.module) for slot in handle.slots} if handle is not None else set()
        entries = self._state_entries
        self._state_entries = lambda: (
            e for e in entries() if e.kind != "param" or id(e.module) in own
        )
        try:
            return original(self, state_dict, strict=False, assign=assign)
        finally:
            del self._state_entries

    StateDictMixin.load_state_dict = load_state_dict


def _load_replaces_flat_params() -> None:
    """A full ``load_state_dict`` loads into new flat parameters instead of the existing ones:
    the optimizer keeps stepping the old ones, which the model no longer uses."""
    import torch
    from torch import nn

    from fsdp_conformance.impl.state import fsdp_states
    from fsdp_conformance.impl.state_dict import StateDictMixin

    original = StateDictMixin.load_state_dict

    def load_state_dict(self, state_dict, strict=True, assign=False):
        for state in fsdp_states(self._fsdp_state.owner):
            handle = state.handle
            if handle is not None:
                old = handle.flat_param
                handle.flat_param = nn.Parameter(old.detach().clone(), old.requires_grad)
                if state.owner._parameters.get("_flat_param") is old:
                    state.owner._parameters["_flat_param"] = handle.flat_param
        with torch.no_grad():
            return original(self, state_dict, strict=strict, assign=assign)

    StateDictMixin.load_state_dict = load_state_dict


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


class LoadSkipsNested(_Mutant):
    name = "impl-load-skips-nested"
    patch = staticmethod(_load_skips_nested)


class LoadReplacesFlatParams(_Mutant):
    name = "impl-load-replaces-flat-params"
    patch = staticmethod(_load_replaces_flat_params)

    # no meta-device init: only the state-dict round trip between steps can find it
    declarations = dataclasses.replace(
        ImplAdapter.declarations,
        unsupported={
            **ImplAdapter.declarations.unsupported,
            Feature.META_INIT: "left out by this test",
        },
    )


LOAD_SKIPS_NESTED = LoadSkipsNested()
LOAD_REPLACES_FLAT_PARAMS = LoadReplacesFlatParams()
