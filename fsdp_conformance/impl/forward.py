"""Forward, ``no_sync`` and ``summon_full_params`` of the reference FSDP: the wrapped module
runs with its parameters unsharded.

``ForwardMixin`` is one base class of ``FullyShardedDataParallel`` (``fully_sharded.py``, which
holds construction); the hooks around the wrapped module's forward are in ``runtime.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from fsdp_conformance.impl import runtime, trace
from fsdp_conformance.impl.state import HandleTrainingState, TrainingState, transition
from fsdp_conformance.vocab import Op

if TYPE_CHECKING:
    from fsdp_conformance.impl.fully_sharded import FullyShardedDataParallel


class ForwardMixin:
    """``forward``, ``no_sync`` and ``summon_full_params`` of ``FullyShardedDataParallel``."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training_state == TrainingState.SUMMON_FULL_PARAMS:
            raise RuntimeError(
                f"forward of FSDP instance {self._fsdp_name()} called inside "
                "summon_full_params; exit the summon_full_params context before forward"
            )
        with torch.autograd.profiler.record_function("FullyShardedDataParallel.forward"):
            runtime.root_pre_forward(self)
            if self._is_root and self.compute_device.type != "cpu":
                device = self.compute_device
                args, kwargs = tree_map_only(
                    torch.Tensor, lambda t: t.to(device, non_blocking=True), (args, kwargs)
                )
            args, kwargs = runtime.pre_forward(self, args, kwargs)
            output = self._fsdp_wrapped_module(*args, **kwargs)
            return runtime.post_forward(self, output)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (unsharded, no communication) inside the block.

        The first backward after the block reduces the accumulated gradients.
        """
        if self._is_root is False:
            raise RuntimeError(
                f"no_sync() called on the non-root FSDP instance {self._fsdp_name()}; call it on "
                "the root (outermost) instance"
            )
        instances = self.fsdp_modules(self)
        previous = [instance._sync_gradients for instance in instances]
        for instance in instances:
            instance._sync_gradients = False
        try:
            yield
        finally:
            for instance, value in zip(instances, previous):
                instance._sync_gradients = value

    # ------------------------------------------------------------------ summon_full_params
    @contextlib.contextmanager
    def summon_full_params(
        self,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        recurse: bool = True,
    ) -> Iterator[None]:
        """Expose the full (unsharded, original-dtype) parameters inside the block.

        The original parameter attributes of the wrapped modules become views of the
        gathered flat parameter. A collective: call on all ranks.

        Args:
            writeback: copy modifications back into the shards on exit.
            rank0_only: only global rank 0 gets the full parameters (needs writeback=False).
            offload_to_cpu: gather into CPU memory.
            recurse: also unshard every nested instance (default True).
        """
        if rank0_only and writeback:
            raise ValueError(
                "summon_full_params(rank0_only=True, writeback=True) is not supported: other "
                "ranks would write back nothing; pass writeback=False"
            )
        instances = self.fsdp_modules(self) if recurse else [self]
        for instance in instances:
            if instance.training_state != TrainingState.IDLE:
                raise RuntimeError(
                    f"summon_full_params on {self._fsdp_name()} while FSDP instance "
                    f"{instance._fsdp_name()} is in {instance.training_state.name}; call it "
                    "outside forward/backward (before forward or after backward) and not nested "
                    "in another summon_full_params"
                )
        gets_params = not rank0_only or dist.get_rank() == 0
        entered: list[FullyShardedDataParallel] = []
        try:
            for instance in instances:
                transition(instance, TrainingState.SUMMON_FULL_PARAMS, "summon_full_params")
                transition(instance, HandleTrainingState.SUMMON_FULL_PARAMS, "summon_full_params")
                entered.append(instance)
                handle = instance._handle
                if handle is None:
                    continue
                full = handle.gather_full_precision(offload_to_cpu and gets_params, not writeback)
                saved = [(s.module, s.name, s.module.__dict__.get(s.name)) for s in handle.slots]
                instance._summon = (full, saved)
                if gets_params:
                    # [Note: summoned parameters] the flat parameter steps aside and the
                    # original parameters are registered as views of the full tensor, so
                    # parameters()/named_parameters() show original names and shapes.
                    del instance._parameters["_flat_param"]
                    handle.register_views_as_params(full)
            yield
        finally:
            for instance in reversed(entered):
                if instance._summon is not None:
                    full, saved = instance._summon
                    instance._summon = None
                    if writeback:
                        instance._handle.write_back(full)
                    if "_flat_param" not in instance._parameters:  # views were registered
                        instance._handle.unregister_params()
                        instance._parameters["_flat_param"] = instance._handle.flat_param
                    for module, name, value in saved:
                        module.__dict__[name] = value
                    if instance._handle.sharded:
                        trace.emit(Op.FREE, instance, event=None, phase="summon")
                instance.handle_training_state = HandleTrainingState.IDLE
                instance.training_state = TrainingState.IDLE
