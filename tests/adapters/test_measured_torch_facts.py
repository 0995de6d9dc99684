"""The torch FSDP1/FSDP2 facts behind the declared capabilities, re-measured on this host.

If a torch release lifts one of these limits, the test fails and the declaration in
torch_fsdp1.py / torch_fsdp2.py (and docs/adapters.md) must be updated.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_conformance.device_handle import accelerator_available

pytestmark = pytest.mark.skipif(accelerator_available(), reason="facts about CPU-only hosts")

# What pinning host memory says without an accelerator: the CPU build of torch and a CUDA
# build on a host without a GPU word it differently, and torch 2.8's FSDP2 checks first (all
# measured: 2.13.0+cpu "Cannot access accelerator device"; 2.14.1+cu130, 2.15.0+cu132 "Found
# no NVIDIA driver"; FSDP2 on 2.8.0+cu128 "CPU device type not an accelerator")
NO_ACCELERATOR = (
    r"Cannot access accelerator device|Found no NVIDIA driver|CPU device type not an accelerator"
)


def _model():
    return nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 8))


def _step(model):
    model(torch.rand(4, 8)).sum().backward()


@pytest.mark.world_size(2)
def test_torch_fsdp1_on_a_cpu_only_host(dist):
    from torch.distributed.fsdp import CPUOffload
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    cpu = torch.device("cpu")
    with pytest.raises(RuntimeError, match="non-CPU accelerator"):
        FSDP(_model())  # no device_id
    _step(FSDP(_model(), device_id=cpu))  # works with device_id=cpu
    offloaded = FSDP(_model(), device_id=cpu, cpu_offload=CPUOffload(offload_params=True))
    with pytest.raises(RuntimeError, match=NO_ACCELERATOR):
        _step(offloaded)
    with pytest.raises(ValueError, match="sync_module_states=True"):
        FSDP(_model(), device_id=cpu, sync_module_states=True)


@pytest.mark.world_size(2)
def test_torch_fsdp2_cpu_offload_needs_pin_memory_false(dist):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    mesh = DeviceMesh.from_group(dist.group, "cpu")
    with pytest.raises(RuntimeError, match=NO_ACCELERATOR):
        _step(fully_shard(_model(), mesh=mesh, offload_policy=CPUOffloadPolicy()))
    _step(fully_shard(_model(), mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False)))
