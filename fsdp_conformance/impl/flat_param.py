"""One instance's flat parameter: flatten, pad, shard; unsharded buffer and views.

The optimizer sees ``flat_param``: this rank's shard (in the original dtype) of the padded,
flattened original parameters. Compute uses ``unsharded``: a leaf tensor whose storage is the
padded unsharded buffer ``full_padded`` (all-gathered in ``param_dtype``). The original
parameters are removed from their modules and replaced by plain-tensor views of
``unsharded``, so autograd accumulates their gradients into ``unsharded.grad``.

[Note: storage swap]
``full_padded`` is allocated once; freeing it resizes its storage to zero and unsharding
resizes it back and all-gathers into it. ``unsharded`` shares that storage through
``.data`` but keeps its own version counter, so autograd's saved views stay valid across
the re-all-gather of backward (the write bumps only ``full_padded``'s counter).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_conformance.impl import comm
from fsdp_conformance.impl.api import MixedPrecision, ShardingStrategy


class ParamSlot(NamedTuple):
    """Where one original parameter lived (a tied parameter has several slots)."""

    # module the parameter was registered on
    module: nn.Module
    # attribute name on ``module``
    name: str
    # index of the (deduplicated) original parameter in the flat parameter
    index: int


class PendingReduction(NamedTuple):
    """A gradient reduction in flight."""

    # the collective's work handle (None: nothing to wait for)
    work: Any
    # the reduced gradient (this rank's shard, or the all-reduced full gradient)
    output: torch.Tensor
    # the unsharded gradient the collective reads (kept alive until the wait)
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
    ) -> None:
        # - Identity
        # the FSDP instance owning this handle (reported in traces)
        self.owner = owner
        # process group the flat parameter is sharded over
        self.process_group = process_group
        # size of ``process_group``
        self.world_size = process_group.size()
        # this rank's index in ``process_group``
        self.rank = process_group.rank()
        # strategy in effect: a one-rank group never shards
        self.strategy = ShardingStrategy.NO_SHARD if self.world_size == 1 else strategy
        # True if each rank holds only a shard (all-gathers needed)
        self.sharded = self.strategy != ShardingStrategy.NO_SHARD

        # - Original parameters
        # one slot per (module, attribute) that held a parameter
        self.slots: list[ParamSlot] = []
        unique: list[nn.Parameter] = []
        index_of: dict[int, int] = {}
        for module, name, param in params:
            if id(param) not in index_of:
                index_of[id(param)] = len(unique)
                unique.append(param)
            self.slots.append(ParamSlot(module, name, index_of[id(param)]))
        # shapes of the deduplicated original parameters
        self.shapes: list[torch.Size] = [p.shape for p in unique]
        # element counts of the deduplicated original parameters
        self.numels: list[int] = [p.numel() for p in unique]
        # element count of the flat parameter before padding
        self.numel = sum(self.numels)
        # whether the original parameters require gradients (uniform, checked by the caller)
        self.requires_grad = unique[0].requires_grad
        # dtype of the original parameters (the master shard keeps it)
        self.orig_dtype = unique[0].dtype

        # - Sharding
        padded = (
            math.ceil(self.numel / self.world_size) * self.world_size
            if self.sharded
            else self.numel
        )
        # element count of the padded unsharded flat parameter
        self.padded_numel = padded
        # element count of one rank's shard
        self.shard_numel = padded // self.world_size if self.sharded else self.numel
        # device computation runs on
        self.compute_device = compute_device
        mp = mixed_precision or MixedPrecision()
        # dtype of the unsharded parameters (all-gather and compute)
        self.compute_dtype = mp.param_dtype or self.orig_dtype
        # dtype gradients are reduced in
        self.reduce_dtype = mp.reduce_dtype or self.compute_dtype
        # whether forward inputs are cast to compute_dtype
        self.cast_forward_inputs = mp.cast_forward_inputs
        # no_sync's unreduced gradient in the original dtype (None: nothing accumulated)
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
        # this rank's shard: the parameter the optimizer updates (original dtype)
        self.flat_param = nn.Parameter(shard, requires_grad=self.requires_grad)

        # - Unsharded buffer (see [Note: storage swap])
        # True if unsharding writes a separate buffer (else the shard is used in place)
        self.copies = (
            self.sharded or self.compute_dtype != self.orig_dtype or shard.device != compute_device
        )
        if self.copies:
            full = torch.empty(padded, dtype=self.compute_dtype, device=compute_device)
            full[: self.numel].copy_(flat[: self.numel])
        else:
            full = self.flat_param.data
        # padded unsharded flat parameter; storage size 0 while resharded
        self.full_padded = full
        # autograd leaf sharing ``full_padded``'s storage; views of it replace the originals
        self.unsharded = torch.empty(0, dtype=self.compute_dtype, device=compute_device)
        self.unsharded.data = full
        self.unsharded.requires_grad_(self.requires_grad)
        for slot in self.slots:
            slot.module._parameters.pop(slot.name, None)
        with torch.no_grad():
            self.use_views(self.unsharded)
        if self.copies:
            self._resize(0)

        # - Communication state
        # work handle of the all-gather in flight (None: none pending)
        self.all_gather_work: Any = None
        # the shard the pending all-gather reads (kept alive until the wait)
        self.all_gather_input: torch.Tensor | None = None

    # ------------------------------------------------------------------ unshard / reshard
    @property
    def is_unsharded(self) -> bool:
        """True while the unsharded flat parameter's storage is allocated."""
        return self.full_padded.untyped_storage().size() > 0

    @property
    def all_gather_pending(self) -> bool:
        return self.all_gather_work is not None

    def _resize(self, numel: int) -> None:
        storage = self.full_padded.untyped_storage()
        nbytes = numel * self.full_padded.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)

    def issue_unshard(self, **info: Any) -> None:
        """Allocate the unsharded buffer and start filling it (all-gather or copy).

        Call under the unshard stream. Postcondition: ``full_padded`` is allocated; for a
        sharded strategy the all-gather is pending until ``wait_unshard``.
        """
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
        """Wait for the pending all-gather, if any (called right before compute)."""
        if self.all_gather_work is None:
            return
        comm.wait_all_gather(self.owner, self.all_gather_work)
        if self.all_gather_input is not None:
            device_handle.record_stream(self.all_gather_input, device_handle.current_stream())
        self.all_gather_work = None
        self.all_gather_input = None

    def use_views(self, flat: torch.Tensor) -> None:
        """Point every original parameter's attribute at a view of ``flat``.

        Called with ``unsharded`` under grad mode, the views are autograd-connected to it.
        """
        views = [
            t.view(shape)
            for t, shape in zip(torch.split(flat[: self.numel], self.numels), self.shapes)
        ]
        for slot in self.slots:
            slot.module.__dict__[slot.name] = views[slot.index]

    def free(self, device_handle: Any) -> None:
        """Free the unsharded buffer (its memory waits for the current stream's work)."""
        device_handle.record_stream(self.full_padded, device_handle.current_stream())
        self._resize(0)

    # ------------------------------------------------------------------ gradients
    def accumulate_unsynced_grad(self) -> None:
        """Inside ``no_sync``: add the unsharded gradient to ``unsynced_grad`` in the original
        dtype (a low-precision sum over many micro-batches would lose their small terms)."""
        grad = self.unsharded.grad
        if grad is None or grad.dtype == self.orig_dtype:
            return  # the same dtype: autograd keeps accumulating into unsharded.grad
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

    # ------------------------------------------------------------------ summon
    def gather_full_precision(self, offload_to_cpu: bool, clone: bool) -> torch.Tensor:
        """Return the unpadded unsharded flat parameter in the master dtype (collective)."""
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
        """Register the original parameters as ``nn.Parameter`` views of ``flat``.

        Inside ``summon_full_params`` this makes ``named_parameters()`` list the original
        names and full shapes (a tied parameter is one object under each of its names), and
        in-place updates of those parameters write into ``flat``. ``unregister_params`` undoes
        it (the caller puts the saved attributes back).
        """
        views = [
            t.view(shape)
            for t, shape in zip(torch.split(flat[: self.numel], self.numels), self.shapes)
        ]
        params = [nn.Parameter(view, requires_grad=self.requires_grad) for view in views]
        for slot in self.slots:
            slot.module.__dict__.pop(slot.name, None)
            slot.module._parameters[slot.name] = params[slot.index]

    def unregister_params(self) -> None:
        """Remove the parameters ``register_views_as_params`` registered."""
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
