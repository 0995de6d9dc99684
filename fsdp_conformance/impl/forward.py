"""``ForwardMixin`` (a base of ``FullyShardedDataParallel``, reading only its ``FSDPState``):
forward, ``no_sync`` and ``summon_full_params``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from fsdp_conformance.constants import Op

from . import runtime, trace
from .state import FSDPState, HandleTrainingState, TrainingState, fsdp_states, transition


class ForwardMixin:
    _fsdp_state: FSDPState

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return run_as_forward(self._fsdp_state, self._fsdp_state.module, args, kwargs)

    def register_forward_method(self, name: str) -> None:
        """Make ``self.<name>(...)`` run the wrapped module's method ``name`` as ``forward``
        runs (e.g. ``generate``).

        Raises:
            TypeError: the wrapped module has no method ``name``.
            ValueError: ``name`` is ``forward`` (it runs so already).
        """
        state = self._fsdp_state
        if name == "forward":
            raise ValueError("register_forward_method('forward'): forward runs so already")
        method = getattr(state.module, name, None)
        if not callable(method):
            raise TypeError(
                f"register_forward_method({name!r}): {type(state.module).__name__}.{name} is not "
                "a method; give the name of a method of the wrapped module"
            )
        self.__dict__[name] = lambda *args, **kwargs: run_as_forward(state, method, args, kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block; the next synced backward reduces the
        sum."""
        state = self._fsdp_state
        if state.is_root is False:
            raise RuntimeError(
                f"no_sync() called on the non-root FSDP instance {state.name()}; call it on "
                "the root (outermost) instance"
            )
        states = fsdp_states(state.owner)
        previous = [other.sync_gradients for other in states]
        for other in states:
            other.sync_gradients = False
        try:
            yield
        finally:
            for other, value in zip(states, previous):
                other.sync_gradients = value

    def summon_full_params(
        self,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        recurse: bool = True,
    ) -> contextlib.AbstractContextManager[None]:
        """Expose the full original-dtype parameters inside the block (a collective).

        Args:
            writeback: copy modifications back into the shards on exit.
            rank0_only: only global rank 0 gets the full parameters (needs writeback=False).
            offload_to_cpu: gather into CPU memory.
            recurse: also unshard every nested instance.
        """
        return summon_full_params(self._fsdp_state, writeback, rank0_only, offload_to_cpu, recurse)


@contextlib.contextmanager
def summon_full_params(
    state: FSDPState, writeback: bool, rank0_only: bool, offload_to_cpu: bool, recurse: bool
) -> Iterator[None]:
    if rank0_only and writeback:
        raise ValueError(
            "summon_full_params(rank0_only=True, writeback=True) is not supported: other "
            "ranks would write back nothing; pass writeback=False"
        )
    states = fsdp_states(state.owner) if recurse else [state]
    for other in states:
        if other.training_state != TrainingState.IDLE:
            raise RuntimeError(
                f"summon_full_params on {state.name()} while FSDP instance "
                f"{other.name()} is in {other.training_state.name}; call it "
                "outside forward/backward (before forward or after backward) and not nested "
                "in another summon_full_params"
            )
    gets_params = not rank0_only or dist.get_rank() == 0
    entered: list[FSDPState] = []
    try:
        for other in states:
            transition(other, TrainingState.SUMMON_FULL_PARAMS, "summon_full_params")
            transition(other, HandleTrainingState.SUMMON_FULL_PARAMS, "summon_full_params")
            entered.append(other)
            handle = other.handle
            if handle is None:
                continue
            full = handle.gather_full_precision(offload_to_cpu and gets_params, not writeback)
            saved = [(s.module, s.name, s.module.__dict__.get(s.name)) for s in handle.slots]
            other.summon = (full, saved)
            if gets_params:
                # [Note: summoned parameters] the original parameters are registered as views
                # of the full tensor in place of the flat parameter
                del other.owner._parameters["_flat_param"]
                handle.register_views_as_params(full)
        yield
    finally:
        for other in reversed(entered):
            if other.summon is not None:
                full, saved = other.summon
                other.summon = None
                if writeback:
                    other.handle.write_back(full)
                if "_flat_param" not in other.owner._parameters:  # views were registered
                    other.handle.unregister_params()
                    other.owner._parameters["_flat_param"] = other.handle.flat_param
                for module, name, value in saved:
                    module.__dict__[name] = value
                if other.handle.sharded:
                    trace.emit(Op.FREE, other.owner, event=None, phase="summon")
            other.handle_training_state = HandleTrainingState.IDLE
            other.training_state = TrainingState.IDLE


def run_as_forward(state: FSDPState, function: Any, args: tuple, kwargs: dict) -> Any:
    """``function(*args, **kwargs)`` (the wrapped module or a method of it) inside the forward
    hooks."""
    if state.training_state == TrainingState.SUMMON_FULL_PARAMS:
        raise RuntimeError(
            f"forward of FSDP instance {state.name()} called inside "
            "summon_full_params; exit the summon_full_params context before forward"
        )
    with torch.autograd.profiler.record_function("FullyShardedDataParallel.forward"):
        runtime.root_pre_forward(state)
        if state.is_root and state.compute_device.type != "cpu":
            device = state.compute_device
            args, kwargs = tree_map_only(
                torch.Tensor, lambda t: t.to(device, non_blocking=True), (args, kwargs)
            )
        args, kwargs = runtime.pre_forward(state, args, kwargs)
        output = function(*args, **kwargs)
        return runtime.post_forward(state, output)
