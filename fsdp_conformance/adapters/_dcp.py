"""Checkpoints through ``torch.distributed.checkpoint`` (DCP) for the torch adapters.

``torch.distributed.checkpoint.state_dict.get_state_dict`` reads a model's and an optimizer's
state the implementation's own way -- torch FSDP1 under ``SHARDED_STATE_DICT`` with
``FSDP.optim_state_dict`` (flat parameters unflattened to the original names, shards as
``ShardedTensor`` / DTensor), torch FSDP2 as DTensors -- and ``dcp.save`` writes every rank's
shards with the metadata to lay them out again at another world size; ``dcp.load`` reads into
the state dicts of the freshly wrapped model (whose shards follow the *current* sharding:
resharding), and ``set_state_dict`` loads them. ``get_state_dict`` also creates the
optimizer's state of a fresh optimizer first (a step with zero gradients, lr unchanged), so the
template names every state tensor and the load fills them. Collective over ``group``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn


def save(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str, group: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    os.makedirs(directory, exist_ok=True)
    dcp.save(
        {"model": model_state, "optimizer": optimizer_state},
        checkpoint_id=directory,
        process_group=group,
    )


def load(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str, group: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=directory, process_group=group)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
    )
