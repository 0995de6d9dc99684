"""Public configuration types of the reference FSDP (torch FSDP1's names)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import torch


class ShardingStrategy(enum.Enum):
    """FULL_SHARD: free the unsharded parameters after forward and backward (ZeRO-3);
    SHARD_GRAD_OP: keep them from forward to the end of backward (ZeRO-2); NO_SHARD: replicate
    and all-reduce gradients (DDP)."""

    FULL_SHARD = enum.auto()
    SHARD_GRAD_OP = enum.auto()
    NO_SHARD = enum.auto()


class BackwardPrefetch(enum.Enum):
    """When the next instance's all-gather is issued in backward: right after the current
    instance's unshard in pre-backward, or after its reshard in post-backward."""

    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()


class StateDictType(enum.Enum):
    """FULL_STATE_DICT: unsharded tensors under the original names; SHARDED_STATE_DICT: this
    rank's ``ShardedFlatParameter`` per instance plus buffers and ignored parameters."""

    FULL_STATE_DICT = enum.auto()
    SHARDED_STATE_DICT = enum.auto()


@dataclass(frozen=True)
class CPUOffload:
    """``offload_params=True``: the flat parameter shard and its gradient live on the CPU and
    are copied to the compute device only to be all-gathered (pinned when an accelerator
    exists)."""

    offload_params: bool = False


@dataclass(frozen=True)
class MixedPrecision:
    """Low-precision compute and communication; the sharded master parameters stay fp32.

    Args:
        param_dtype: all-gather and compute dtype (also for floating-point forward inputs);
            ``None``: the original dtype.
        reduce_dtype: gradient reduction dtype; ``None``: ``param_dtype``. Gradients accumulate
            in the original dtype.
        buffer_dtype: floating-point buffers are cast to it at lazy init (the state dict
            returns the original dtype); ``None``: unchanged.
        output_dtype: the root casts its floating-point outputs to it; ``None``: unchanged.
        cast_forward_inputs: each instance casts floating-point forward inputs to
            ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


class ShardedFlatParameter(NamedTuple):
    """One instance's sharded state-dict entry: this rank's fp32 shard of the padded flat
    parameter, its rank and group size, and the flat parameter's unpadded element count."""

    shard: torch.Tensor
    rank: int
    world_size: int
    unpadded_numel: int
