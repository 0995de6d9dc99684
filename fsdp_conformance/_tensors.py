"""The tensors of a forward's output (shared by impl's hooks and observe's state recorder).

Shared layer: imports nothing of this project.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils._pytree import tree_flatten


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in a forward's output: pytree containers and, inside them, dataclass
    instances (not pytree nodes unless registered; a module returning one must still get its
    pre-backward hooks and its tensors still get gradients -- found by the fuzzer, docs/fuzz.md).
    """
    found = []
    for leaf in tree_flatten(output)[0]:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            fields = [getattr(leaf, field.name) for field in dataclasses.fields(leaf)]
            found += output_tensors(fields)
    return found
