"""Checkpoints through ``torch.distributed.checkpoint`` (DCP) for the torch adapters, called as
users call it.

``torch.distributed.checkpoint.state_dict.get_state_dict`` reads a model's and an optimizer's
state the implementation's own way -- torch FSDP1 under ``SHARDED_STATE_DICT`` with
``FSDP.optim_state_dict`` (flat parameters unflattened to the original names, shards as
``ShardedTensor`` / DTensor), torch FSDP2 as DTensors -- and ``dcp.save`` writes every rank's
shards with the metadata to lay them out again at another world size; ``dcp.load`` reads into
the state dicts of the freshly wrapped model (whose shards follow the *current* sharding:
resharding), and ``set_state_dict`` loads them. ``get_state_dict`` also creates the
optimizer's state of a fresh optimizer first (a step with zero gradients, lr unchanged), so the
template names every state tensor and the load fills them. Collective over ``group``.

[Note: DCP on a subgroup with FSDP1]
``get_state_dict`` / ``set_state_dict`` call ``FSDP.optim_state_dict`` /
``optim_state_dict_to_load`` without ``group=`` on torch releases before the fix of
pytorch/pytorch#180449 (PR #181261, April 2026): FSDP1's optimizer-state collectives then run on
the default group, and a model on a subgroup deadlocks against the ranks outside it. Measured
on torch 2.8.0 (the checkpoint/resume cells across world sizes hung); 2.13.0, 2.14.1 and 2.15.0
pass the group. Releases 2.9 to 2.12 were not run: the range is every tested release before
2.13. There torch-fsdp1 declares ``checkpoint_resume`` unsupported (``FSDP1_SUBGROUP_REASON``):
per feature, so every rank of a cell decides alike before any collective (a cell deciding on
one rank only, inside the body, would leave the others waiting); the adapter never hands DCP the
group itself.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ._support import release

# the first tested torch release whose get_state_dict / set_state_dict pass FSDP1 its group
FSDP1_GROUP_PASSED_FROM = (2, 13, 0)
# why torch-fsdp1 does not declare checkpoint_resume on an earlier torch
FSDP1_SUBGROUP_REASON = (
    "this torch's get_state_dict / set_state_dict call FSDP.optim_state_dict(_to_load) without "
    "the model's process group, so a checkpoint of a model on a subgroup deadlocks (FSDP1's "
    "optimizer-state collectives run on the default group; measured on torch 2.8.0, passed "
    "from 2.13.0, pytorch/pytorch#180449)"
)


def fsdp1_group_dropped(version: str | None = None) -> bool:
    """Whether this torch (``version``: the installed one by default) is one whose DCP helpers
    drop FSDP1's group: see [Note: DCP on a subgroup with FSDP1]."""
    return release(torch.__version__ if version is None else version) < FSDP1_GROUP_PASSED_FROM


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
