"""Gradient clipping by the global norm over every shard (``clip_grad_norm_``).

Per-shard ``sum |g|^p`` (or the max, for ``inf``) is all-reduced over the root's group. A
NO_SHARD instance's gradient, whole on every rank, is counted by its group's first rank only;
padding is zero. Then gradients are scaled as ``torch.nn.utils.clip_grad_norm_`` does.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

# torch.nn.utils.clip_grad_norm_'s guard against division by zero
EPSILON = 1e-6


def clip_grad_norm_(root: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip every gradient under the root ``root`` by the global norm (> 0) of order
    ``norm_type`` (> 0 or ``inf``); returns the norm before clipping. A collective."""
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    if not max_norm > 0:
        raise ValueError(f"clip_grad_norm_: max_norm={max_norm!r} must be > 0")
    if not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: norm_type={norm_type!r} must be > 0 or inf")
    if root.is_root is False:
        raise RuntimeError(
            f"clip_grad_norm_ called on the non-root FSDP instance {root._fsdp_state.name()}; "
            "call it on the root (outermost) instance"
        )
    grads: list[torch.Tensor] = []
    local = torch.zeros((), dtype=torch.float64)
    for instance in root.fsdp_modules(root):
        handle = instance._fsdp_state.handle
        if handle is None or handle.flat_param.grad is None:
            continue
        grad = handle.flat_param.grad
        grads.append(grad)
        if handle.sharded or dist.get_rank(handle.process_group) == 0:
            local = _accumulate(local, grad, norm_type)
    unmanaged = _unmanaged_grads(root)
    grads.extend(unmanaged)
    if dist.get_rank(root.process_group) == 0:  # replicated: count them once
        for grad in unmanaged:
            local = _accumulate(local, grad, norm_type)
    total = local.to(root.compute_device)
    if root.process_group.size() > 1:
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(total, op=op, group=root.process_group)
    if not math.isinf(norm_type):
        total = total.pow(1.0 / norm_type)
    total = total.float()
    coefficient = max_norm / (total + EPSILON)
    if coefficient < 1:
        for grad in grads:
            grad.mul_(coefficient.to(grad.device, grad.dtype))
    return total


def _accumulate(local: torch.Tensor, grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    if math.isinf(norm_type):
        return torch.maximum(local, grad.detach().abs().max().double().cpu())
    return local + grad.detach().double().abs().pow(norm_type).sum().cpu()


def _unmanaged_grads(root: nn.Module) -> list[torch.Tensor]:
    """Gradients of parameters no instance flattened (replicated: the same on every rank)."""
    flat = {id(i.flat_param) for i in root.fsdp_modules(root) if i.flat_param is not None}
    return [p.grad for p in root.parameters() if id(p) not in flat and p.grad is not None]
