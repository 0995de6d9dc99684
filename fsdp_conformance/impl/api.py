"""Public configuration types of the reference FSDP (seed vocabulary: torch FSDP1's names)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import torch


class ShardingStrategy(enum.Enum):
    """How parameters and gradients are split across the ranks of the process group."""

    # Shard parameters, gradients and optimizer state; free the unsharded parameters
    # after forward and again after backward (ZeRO-3).
    FULL_SHARD = enum.auto()
    # Like FULL_SHARD but keep the unsharded parameters from forward until the end of
    # backward, so backward does not all-gather (ZeRO-2).
    SHARD_GRAD_OP = enum.auto()
    # Replicate parameters; all-reduce gradients (DDP). Never all-gathers.
    NO_SHARD = enum.auto()


class BackwardPrefetch(enum.Enum):
    """When the next instance's all-gather is issued during backward."""

    # In the pre-backward hook, right after the current instance's own unshard
    # (before its gradient computation): most overlap, one extra resident buffer.
    BACKWARD_PRE = enum.auto()
    # In the post-backward hook, right after the current instance's reshard.
    BACKWARD_POST = enum.auto()


class StateDictType(enum.Enum):
    """Form of ``state_dict()``."""

    # Unflattened, unsharded tensors under the original parameter names.
    FULL_STATE_DICT = enum.auto()
    # This rank's shard of each flat parameter (``ShardedFlatParameter``) plus
    # buffers and ignored parameters under their original names.
    SHARDED_STATE_DICT = enum.auto()


@dataclass(frozen=True)
class CPUOffload:
    """Keep the sharded parameters and their gradients in CPU memory.

    Args:
        offload_params: if True, the flat parameter shard and its gradient live on the
            CPU; they are copied to the compute device only to be all-gathered. Works on
            hosts without an accelerator (memory is pinned only when one exists).
    """

    offload_params: bool = False


@dataclass(frozen=True)
class MixedPrecision:
    """Low-precision compute and communication; the sharded master parameters stay fp32.

    Args:
        param_dtype: dtype parameters are all-gathered and computed in (also the dtype
            floating-point forward inputs are cast to). ``None``: the original dtype.
        reduce_dtype: dtype gradients are reduced in. ``None``: ``param_dtype``. Gradients
            accumulate in the original dtype: across ``no_sync`` micro-batches and after
            each reduction.
        buffer_dtype: dtype floating-point buffers are cast to at lazy init (the state
            dict returns them in their original dtype). ``None``: unchanged.
        output_dtype: dtype the root casts its floating-point outputs to. ``None``: unchanged.
        cast_forward_inputs: whether each instance casts its floating-point forward inputs
            to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


class ShardedFlatParameter(NamedTuple):
    """One instance's entry in a sharded state dict."""

    # this rank's shard of the padded flat parameter (fp32, detached copy)
    shard: torch.Tensor
    # rank in the instance's process group that owns ``shard``
    rank: int
    # size of the instance's process group when the state dict was taken
    world_size: int
    # number of elements of the flat parameter before padding
    unpadded_numel: int
