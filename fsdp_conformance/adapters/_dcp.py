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

import contextlib
import functools
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

# the process group get_state_dict / set_state_dict should hand FSDP1 (per rank thread)
_GROUP = threading.local()
_PATCH_KEY = "fsdp-conformance DCP group for FSDP1 optimizer state (torch 2.8)"


@functools.cache
def fsdp1_optim_group_passed() -> bool:
    """Whether this torch's ``get_state_dict`` hands ``FSDP.optim_state_dict`` the model's
    process group. torch 2.8.0's does not (2.13.0 does): FSDP1's optimizer-state collectives
    then run on the default group, and a model on a subgroup deadlocks against the ranks
    outside it (measured: the checkpoint/resume cells across world sizes hung)."""
    import inspect

    from torch.distributed.checkpoint import state_dict

    try:
        source = inspect.getsource(state_dict._get_optim_state_dict)
    except (AttributeError, OSError, TypeError):
        return True  # cannot tell: assume the fixed form
    return "group=" in source


@contextlib.contextmanager
def _fsdp1_optim_group(group: Any) -> Iterator[None]:
    """On a torch whose DCP helpers omit the group, hand it to FSDP1's ``optim_state_dict`` /
    ``optim_state_dict_to_load`` while the helpers run (a keyword they leave unset); elsewhere
    nothing."""
    if group is None or fsdp1_optim_group_passed():
        yield
        return
    from torch.distributed.fsdp import FullyShardedDataParallel

    from fsdp_conformance._patching import patch_attribute

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def with_group(*args: Any, **kwargs: Any) -> Any:
            bound = getattr(_GROUP, "group", None)
            if bound is not None and kwargs.get("group") is None:
                kwargs["group"] = bound
            return original(*args, **kwargs)

        return staticmethod(with_group)

    for name in ("optim_state_dict", "optim_state_dict_to_load"):
        patch_attribute(
            FullyShardedDataParallel, name, make, key=_PATCH_KEY, written_for="torch 2.8.0"
        )
    _GROUP.group = group
    try:
        yield
    finally:
        _GROUP.group = None


def save(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str, group: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    with _fsdp1_optim_group(group):
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

    with _fsdp1_optim_group(group):
        model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=directory, process_group=group)
    with _fsdp1_optim_group(group):
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
