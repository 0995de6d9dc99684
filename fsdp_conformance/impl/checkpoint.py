"""Checkpoints of the reference FSDP: model and optimizer state, loadable at any world size.

One file, ``directory/impl_checkpoint.pt``: the full model state dict and, per flat parameter
(by its name in ``root.named_parameters()``), the optimizer state with per-element tensors
gathered into the unpadded full flat tensor. Loading cuts them into this rank's shard of the
*current* sharding. Both are collectives over ``root.process_group``.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

FILE_NAME = "impl_checkpoint.pt"
FORMAT = "fsdp_conformance.impl checkpoint v1"


def save_checkpoint(root: nn.Module, optimizer: torch.optim.Optimizer, directory: str) -> None:
    """Write ``root``'s model and optimizer state into ``directory`` (shared by all ranks)."""
    handles = _flat_handles(root)
    model_state = {key: _cpu(value) for key, value in root.state_dict().items()}
    names = _param_names(root, optimizer)
    optimizer_state: dict[str, dict[str, Any]] = {}
    for index, param in enumerate(_optimizer_params(optimizer)):
        handle = handles.get(id(param))
        entry = {}
        for key, value in optimizer.state.get(param, {}).items():
            if handle is not None and _is_per_element(value, handle.shard_numel):
                value = _gather(value, handle)
            entry[key] = _cpu(value)
        optimizer_state[names[index]] = entry
    groups = [
        {key: value for key, value in group.items() if key != "params"}
        for group in optimizer.param_groups
    ]
    payload = {
        "format": FORMAT,
        "model": model_state,
        "optimizer": optimizer_state,
        "param_groups": groups,
    }
    group = root.process_group
    if dist.get_rank(group) == 0:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, FILE_NAME)
        torch.save(payload, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier(group=group)


def load_checkpoint(root: nn.Module, optimizer: torch.optim.Optimizer, directory: str) -> None:
    """Load what ``save_checkpoint`` wrote, at this world size (resharding as needed)."""
    path = os.path.join(directory, FILE_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"load_checkpoint: no {FILE_NAME} in {directory!r}; save with "
            "fsdp_conformance.impl.checkpoint.save_checkpoint first"
        )
    payload = torch.load(path, map_location="cpu", weights_only=False)
    if payload.get("format") != FORMAT:
        raise ValueError(f"load_checkpoint: {path!r} is not a {FORMAT!r} file")
    root.load_state_dict(payload["model"])
    handles = _flat_handles(root)
    names = _param_names(root, optimizer)
    missing = sorted(set(names) - set(payload["optimizer"]))
    if missing:
        raise ValueError(
            f"load_checkpoint: the checkpoint has no optimizer state for {missing}; was it saved "
            "from the same model?"
        )
    state: dict[int, dict[str, Any]] = {}
    for index, param in enumerate(_optimizer_params(optimizer)):
        handle = handles.get(id(param))
        entry = {}
        for key, value in payload["optimizer"][names[index]].items():
            if handle is not None and _is_per_element(value, handle.numel):
                value = _shard(value, handle)
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                value = value.to(param.device)
            entry[key] = value
        if entry:
            state[index] = entry
    groups = []
    for number, indices in enumerate(_group_indices(optimizer)):
        saved = payload["param_groups"][number] if number < len(payload["param_groups"]) else {}
        groups.append({**saved, "params": indices})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _flat_handles(root: nn.Module) -> dict[int, Any]:
    return {
        id(instance.flat_param): instance._fsdp_state.handle
        for instance in root.fsdp_modules(root)
        if instance.flat_param is not None
    }


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [param for group in optimizer.param_groups for param in group["params"]]


def _group_indices(optimizer: torch.optim.Optimizer) -> list[list[int]]:
    """Each group's parameters as their positions in ``_optimizer_params``."""
    position = itertools.count()
    return [[next(position) for _ in group["params"]] for group in optimizer.param_groups]


def _param_names(root: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    by_id = {id(param): name for name, param in root.named_parameters()}
    names = []
    for param in _optimizer_params(optimizer):
        if id(param) not in by_id:
            raise ValueError(
                "checkpoint: the optimizer holds a tensor that is not a parameter of the model; "
                "build the optimizer over root.parameters()"
            )
        names.append(by_id[id(param)])
    return names


def _is_per_element(value: Any, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel != 1


def _gather(shard: torch.Tensor, handle: Any) -> torch.Tensor:
    """The unpadded full flat tensor of a per-element optimizer state shard."""
    if not handle.sharded:
        return shard.detach().clone()[: handle.numel]
    shard = shard.detach().to(handle.compute_device)
    full = torch.empty(handle.padded_numel, dtype=shard.dtype, device=shard.device)
    dist.all_gather_into_tensor(full, shard.contiguous(), group=handle.process_group)
    return full[: handle.numel]


def _shard(full: torch.Tensor, handle: Any) -> torch.Tensor:
    """This rank's shard of an unpadded full flat tensor under the current sharding."""
    if not handle.sharded:
        return full.clone()
    padded = F.pad(full, (0, handle.padded_numel - handle.numel))
    return padded.narrow(0, handle.rank * handle.shard_numel, handle.shard_numel).clone()


def _cpu(value: Any) -> Any:
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
