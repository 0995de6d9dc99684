"""One instance's flat parameter (docs/impl.md): flatten, pad, shard; the unsharded buffer.

[Note: storage swap]
The original parameters are views of ``unsharded``, an autograd leaf sharing the storage of the
padded buffer ``full_padded`` through ``.data``. Freeing resizes that storage to zero and
unsharding resizes it back and all-gathers into it; ``unsharded`` has its own version counter,
so autograd's saved views survive backward's re-all-gather.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from . import comm
from .api import MixedPrecision, ShardingStrategy


class ParamSlot(NamedTuple):
    """Where one original parameter lived (a tied parameter has several slots); ``index``: the
    deduplicated parameter's position in the flat parameter."""

    module: nn.Module
    name: str
    index: int


class PendingReduction(NamedTuple):
    """A gradient reduction in flight: its work handle (None: nothing to wait for), the reduced
    output, and the gradient the collective reads (kept alive until the wait)."""

    work: Any
    output: torch.Tensor
    source: torch.Tensor


class FlatParamHandle:
    """Flat parameter of one FSDP instance and the buffers to unshard it."""

    def __init__(
        self,
        owner: nn.Module,
        params: list[tuple[nn.Module, str, nn.Parameter]],
        process_group: Any,
        strategy: ShardingStrategy,
        mixed_precision: MixedPrecision | None,
        offload_params: bool,
        compute_device: torch.device,
        pin_memory: bool,
        grad_hook: Callable[[torch.Tensor], None],
    ) -> None:
        self.owner = owner  # the FSDP instance (reported in traces)
        self.process_group = process_group
        self.world_size = process_group.size()
        self.rank = process_group.rank()
        # the strategy in effect: a one-rank group never shards
        self.strategy = ShardingStrategy.NO_SHARD if self.world_size == 1 else strategy
        self.sharded = self.strategy != ShardingStrategy.NO_SHARD

        unique = list({id(param): param for _, _, param in params}.values())  # tied: once
        index_of = {id(param): index for index, param in enumerate(unique)}
        self.slots = [
            ParamSlot(module, name, index_of[id(param)]) for module, name, param in params
        ]
        self.shapes: list[torch.Size] = [p.shape for p in unique]
        self.numels: list[int] = [p.numel() for p in unique]
        self.numel = sum(self.numels)  # before padding
        self.requires_grad = unique[0].requires_grad  # uniform, checked by the caller
        self.orig_dtype = unique[0].dtype

        padded = self.numel
        if self.sharded:
            padded = math.ceil(self.numel / self.world_size) * self.world_size
        self.padded_numel = padded
        self.shard_numel = padded // self.world_size if self.sharded else self.numel
        self.compute_device = compute_device
        self.offload_params = offload_params
        mp = mixed_precision or MixedPrecision()
        self.compute_dtype = mp.param_dtype or self.orig_dtype
        self.reduce_dtype = mp.reduce_dtype or self.compute_dtype
        self.cast_forward_inputs = mp.cast_forward_inputs
        # no_sync's unreduced gradient in the original dtype
        self.unsynced_grad: torch.Tensor | None = None
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in unique])
            if self.sharded:
                flat = F.pad(flat, (0, padded - self.numel))
                shard = flat.narrow(0, self.rank * self.shard_numel, self.shard_numel).clone()
            else:
                shard = flat
            shard = shard.to(torch.device("cpu") if offload_params else compute_device)
            if offload_params and pin_memory:
                shard = shard.pin_memory()
        self.flat_param = nn.Parameter(shard, requires_grad=self.requires_grad)

        # False: the shard itself is the unsharded parameter (see [Note: storage swap])
        self.copies = (
            self.sharded or self.compute_dtype != self.orig_dtype or shard.device != compute_device
        )
        for slot in self.slots:
            slot.module._parameters.pop(slot.name, None)
        self.grad_hook = grad_hook
        self._init_unsharded(flat)
        self.all_gather_work: Any = None
        self.all_gather_input: torch.Tensor | None = None  # kept alive until the wait

    def _init_unsharded(self, flat: torch.Tensor | None) -> None:
        """The unsharded buffer on the compute device (``unsharded`` holds it), filled from
        ``flat`` (if given) long enough to point the original parameters at views of it."""
        full = self.flat_param.data
        if self.copies:
            full = torch.empty(
                self.padded_numel, dtype=self.compute_dtype, device=self.compute_device
            )
            if flat is not None:
                full[: self.numel].copy_(flat[: self.numel])
        self.full_padded = full
        self.unsharded = torch.empty(0, dtype=self.compute_dtype, device=self.compute_device)
        self.unsharded.data = full
        if self.requires_grad:
            self.unsharded.requires_grad_(True)
            self.unsharded.register_post_accumulate_grad_hook(self.grad_hook)
        with torch.no_grad():
            self.use_views(self.unsharded)
        if self.copies:
            self._resize(0)

    def follow_flat_param(self) -> None:
        """Compute where the flat parameter is: the module was moved after wrapping
        (``model.to(device)`` before the first forward, as with torch FSDP); a new
        ``unsharded`` tensor (with ``grad_hook``) replaces the old one. Offloaded parameters
        stay on CPU and keep their compute device."""
        # a move to another tensor type (meta, or any move under torch.__future__'s
        # overwrite_module_params_on_conversion) registers a new Parameter object
        self.flat_param = self.owner._parameters.get("_flat_param", self.flat_param)
        device = self.flat_param.device
        if device != self.compute_device and not self.offload_params:
            self.compute_device = device
            self._init_unsharded(None)

    @property
    def is_unsharded(self) -> bool:
        return self.full_padded.untyped_storage().size() > 0

    def _resize(self, numel: int) -> None:
        storage = self.full_padded.untyped_storage()
        nbytes = numel * self.full_padded.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)

    def issue_unshard(self, **info: Any) -> None:
        """Allocate the unsharded buffer and start filling it (under the unshard stream); a
        sharded all-gather stays pending until ``wait_unshard``."""
        source = self.flat_param.detach()
        if source.device != self.compute_device:
            source = source.to(self.compute_device, non_blocking=True)
        if source.dtype != self.compute_dtype:
            source = source.to(self.compute_dtype)
        self._resize(self.padded_numel)
        if self.sharded:
            self.all_gather_input = source
            self.all_gather_work = comm.all_gather(
                self.owner, self.full_padded, source, self.process_group, **info
            )
        else:
            self.full_padded.copy_(source)

    def wait_unshard(self, device_handle: Any) -> None:
        if self.all_gather_work is None:
            return
        comm.wait_all_gather(self.owner, self.all_gather_work)
        if self.all_gather_input is not None:
            device_handle.record_stream(self.all_gather_input, device_handle.current_stream())
        self.all_gather_work = None
        self.all_gather_input = None

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        pieces = torch.split(flat[: self.numel], self.numels)
        return [t.view(shape) for t, shape in zip(pieces, self.shapes, strict=True)]

    def use_views(self, flat: torch.Tensor) -> None:
        """Point every original parameter's attribute at a view of ``flat`` (of ``unsharded``
        under grad mode: autograd-connected to it)."""
        views = self._views(flat)
        for slot in self.slots:
            slot.module.__dict__[slot.name] = views[slot.index]

    def free(self, device_handle: Any) -> None:
        """Free the unsharded buffer (its memory waits for the current stream's work)."""
        device_handle.record_stream(self.full_padded, device_handle.current_stream())
        self._resize(0)

    def accumulate_unsynced_grad(self) -> None:
        """Inside ``no_sync``: add the unsharded gradient to ``unsynced_grad`` in the original
        dtype (a low-precision sum over many micro-batches would lose their small terms)."""
        grad = self.unsharded.grad
        if grad is None or grad.dtype == self.orig_dtype:
            return  # autograd keeps accumulating into unsharded.grad
        self.unsharded.grad = None
        if self.unsynced_grad is None:
            self.unsynced_grad = grad.to(self.orig_dtype)
        else:
            self.unsynced_grad += grad

    def start_grad_reduction(self) -> PendingReduction | None:
        """Take the unsharded gradient and issue its reduction (pre-divided by world size)."""
        self.accumulate_unsynced_grad()
        grad = self.unsharded.grad
        if self.unsynced_grad is not None:
            grad, self.unsynced_grad = self.unsynced_grad, None
        if grad is None:
            return None
        self.unsharded.grad = None
        if grad.dtype != self.reduce_dtype:
            grad = grad.to(self.reduce_dtype)
        if self.world_size > 1:
            grad.div_(self.world_size)
        if self.sharded:
            output = torch.empty(self.shard_numel, dtype=grad.dtype, device=grad.device)
            work = comm.reduce_scatter(self.owner, output, grad, self.process_group)
        elif self.world_size > 1:
            output, work = grad, comm.all_reduce(self.owner, grad, self.process_group)
        else:
            output, work = grad, None
        return PendingReduction(work, output, grad)

    def finish_grad_reduction(self, pending: PendingReduction) -> None:
        """Wait for a reduction and accumulate the result into ``flat_param.grad``."""
        if pending.work is not None:
            pending.work.wait()
        grad = pending.output.to(dtype=self.flat_param.dtype, device=self.flat_param.device)
        if self.flat_param.grad is None:
            self.flat_param.grad = grad
        else:
            self.flat_param.grad += grad

    def gather_full_precision(self, offload_to_cpu: bool, clone: bool) -> torch.Tensor:
        """The unpadded unsharded flat parameter in the master dtype (a collective)."""
        source = self.flat_param.detach()
        if self.sharded:
            source = source.to(self.compute_device)
            full = torch.empty(self.padded_numel, dtype=source.dtype, device=source.device)
            work = comm.all_gather(self.owner, full, source, self.process_group, phase="summon")
            comm.wait_all_gather(self.owner, work)
        else:
            full = source.clone() if clone else source
        if offload_to_cpu:
            full = full.cpu()
        return full[: self.numel]

    def register_views_as_params(self, flat: torch.Tensor) -> None:
        """Register the original parameters as ``nn.Parameter`` views of ``flat``, so that
        inside ``summon_full_params`` ``named_parameters()`` lists original names and shapes
        and in-place updates write into ``flat``."""
        params = [nn.Parameter(v, requires_grad=self.requires_grad) for v in self._views(flat)]
        for slot in self.slots:
            slot.module.__dict__.pop(slot.name, None)
            slot.module._parameters[slot.name] = params[slot.index]

    def unregister_params(self) -> None:
        for slot in self.slots:
            slot.module._parameters.pop(slot.name, None)

    def write_back(self, full: torch.Tensor) -> None:
        """Copy this rank's part of an unsharded flat parameter into the shard."""
        with torch.no_grad():
            if self.sharded:
                start = self.rank * self.shard_numel
                end = min(start + self.shard_numel, self.numel)
                if end > start:
                    self.flat_param.data[: end - start].copy_(full[start:end])
            elif full.data_ptr() != self.flat_param.data_ptr():
                self.flat_param.data.copy_(full)
