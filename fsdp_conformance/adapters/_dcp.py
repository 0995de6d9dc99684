"""Checkpoints through ``torch.distributed.checkpoint`` (DCP) for the torch adapters, as users
call it: ``get_state_dict`` reads model and optimizer state the implementation's way (it also
creates a fresh optimizer's state first), ``dcp.save`` / ``dcp.load`` write and read every
rank's shards (resharding to the current layout), ``set_state_dict`` loads them. Collective
over ``group``.

[Note: DCP on a subgroup with FSDP1]
Before pytorch/pytorch#180449 was fixed, ``get_state_dict`` / ``set_state_dict`` call FSDP1's
``optim_state_dict(_to_load)`` without ``group=``: a model on a subgroup deadlocks against the
ranks outside it (measured on torch 2.8.0; 2.13.0 on pass the group; 2.9-2.12 not run). There
torch-fsdp1 declares ``checkpoint_resume`` unsupported, per feature, so every rank decides alike
before any collective.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ._support import release

FSDP1_GROUP_PASSED_FROM = (2, 13, 0)
# why torch-fsdp1 does not declare checkpoint_resume on an earlier torch
FSDP1_SUBGROUP_REASON = (
    "this torch's get_state_dict / set_state_dict call FSDP.optim_state_dict(_to_load) without "
    "the model's process group, so a checkpoint of a model on a subgroup deadlocks (FSDP1's "
    "optimizer-state collectives run on the default group; measured on torch 2.8.0, passed "
    "from 2.13.0, pytorch/pytorch#180449)"
)


def fsdp1_group_dropped(version: str | None = None) -> bool:
    """Whether this torch's DCP helpers drop FSDP1's group ([Note: DCP on a subgroup with
    FSDP1])."""
    return release(torch.__version__ if version is None else version) < FSDP1_GROUP_PASSED_FROM


def save(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str, group: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    os.makedirs(directory, exist_ok=True)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.save(state, checkpoint_id=directory, process_group=group)


def load(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str, group: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=directory, process_group=group)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
