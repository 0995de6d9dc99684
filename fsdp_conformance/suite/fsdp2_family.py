"""What the checks of the FSDP2 API family share (``Feature.FSDP2_API``: suite/test_fsdp2_api.py
and the ``FSDPModule`` checks): the adapter's FSDP2 namespace, device meshes of the test's ranks,
the ``loops`` model sharded unit by unit, and the full values of DTensors. A family check calls
the API through the namespace only (``ns.fully_shard(...)``), so an FSDP2-compatible
implementation other than torch's runs it unchanged."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn


def api(adapter: Any) -> Any:
    """The adapter's FSDP2 namespace (``Declarations.api["fsdp2"]``: ``fully_shard``,
    ``FSDPModule``, ``MixedPrecisionPolicy``, ...)."""
    return adapter.declarations.api["fsdp2"]


def mesh(dist: Any, shape: tuple[int, ...] = (), names: tuple[str, ...] = ("dp",)) -> Any:
    """A device mesh of the test's ranks (`shape`; default: 1-D over all of them), each dimension
    named ``names[i]`` plus a suffix new in every test: torch keeps a mesh's submeshes and
    flattenings per layout and names, so an equal mesh of an earlier test would hand out that
    test's destroyed groups (measured, torch 2.13.0: "Expected param's DTensor mesh to be the
    same mesh passed to fully_shard"). Read the names back from ``mesh.mesh_dim_names``."""
    from torch.distributed.device_mesh import init_device_mesh

    ranks = list(range(dist.world_size))
    tag = torch_dist.new_group(ranks).group_name  # the same on every rank, new in every test
    return init_device_mesh(
        dist.device.type,
        shape or (dist.world_size,),
        mesh_dim_names=tuple(f"{name}{tag}" for name in names),
    )


@contextlib.contextmanager
def observing(dist: Any, callback: Callable[[Any], None]) -> Iterator[None]:
    """``observing_collectives(callback)`` on every rank at once: entered and left at a barrier,
    so that no rank's collectives outside it reach another's `callback` (ranks that are threads
    of one process see each other's collectives while these do not observe)."""
    from fsdp_conformance.observe.comm_trace import observing_collectives

    with observing_collectives(callback):
        dist.barrier()
        yield
        dist.barrier()


def shard_loops(ns: Any, model: nn.Module, **options: Any) -> nn.Module:
    """``ns.fully_shard`` the zoo's ``loops`` model as users shard a model: each block, the head,
    then the root (the trunk), every unit with `options`; returns the root."""
    for block in model.blocks:
        ns.fully_shard(block, **options)
    ns.fully_shard(model.head, **options)
    return ns.fully_shard(model, **options)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's ``full_tensor()`` (a collective), a plain tensor itself; detached."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return tensor.detach()


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, a plain tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every registered parameter's full value, by name (tied: under each name)."""
    named = model.named_parameters(remove_duplicate=False)
    return {name: full(param).clone() for name, param in named}
