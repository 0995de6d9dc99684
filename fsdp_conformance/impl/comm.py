"""Collectives, each issued with ``async_op=True`` and reported to ``trace``; callers wait right
before the data is used (on NCCL the wait orders the *current* stream after the collective)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fsdp_conformance.constants import Op

from . import trace


# torch 2.13 renamed the tensor collectives; looked up at each call, as torch FSDP does, so a
# wrapper installed on torch.distributed sees them
def _all_gather_tensor(*args: Any, **kwargs: Any) -> Any:
    function = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return function(*args, **kwargs)


def _reduce_scatter_tensor(*args: Any, **kwargs: Any) -> Any:
    function = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return function(*args, **kwargs)


def all_gather(
    instance: Any, output: torch.Tensor, shard: torch.Tensor, group: Any, **info: Any
) -> Any:
    trace.emit(Op.ALL_GATHER, instance, numel=output.numel(), dtype=output.dtype, **info)
    return _all_gather_tensor(output, shard, group=group, async_op=True)


def wait_all_gather(instance: Any, work: Any) -> None:
    trace.emit(Op.ALL_GATHER_WAIT, instance)
    work.wait()


def reduce_scatter(instance: Any, output: torch.Tensor, grad: torch.Tensor, group: Any) -> Any:
    """Issue the sum reduce-scatter of ``grad`` into ``output``."""
    trace.emit(Op.REDUCE_SCATTER, instance, numel=grad.numel(), dtype=grad.dtype)
    return _reduce_scatter_tensor(output, grad, group=group, async_op=True)


def all_reduce(instance: Any, grad: torch.Tensor, group: Any) -> Any:
    """Issue the in-place sum all-reduce of ``grad``."""
    trace.emit(Op.ALL_REDUCE, instance, numel=grad.numel(), dtype=grad.dtype)
    return dist.all_reduce(grad, group=group, async_op=True)
