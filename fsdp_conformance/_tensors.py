"""The tensors of a forward's output (impl's hooks, observe's state recorder). Shared layer."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils._pytree import tree_flatten


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in a forward's output: in pytree containers and in dataclass instances (not
    pytree nodes unless registered, but their tensors still need pre-backward hooks)."""
    found = []
    for leaf in tree_flatten(output)[0]:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            fields = [getattr(leaf, field.name) for field in dataclasses.fields(leaf)]
            found += output_tensors(fields)
    return found
