"""The lagging device installed through adapters: the limiter really waits on it."""

from __future__ import annotations

import pytest
import torch

from fsdp_conformance.adapters import Feature, get_adapter
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.observe import LaggingDevice
from fsdp_conformance.suite.memory_bound import ChainOfLinears


def wrapped_chain(adapter, group, **config):
    wrap = adapter.wrapper(**config)
    chain = ChainOfLinears(lambda module: wrap(module, process_group=group), layers=4)
    return adapter.wrap(chain, process_group=group, **config), chain


@pytest.mark.world_size(2)
@pytest.mark.parametrize("adapter_name", ["impl", "torch-fsdp1"])
@pytest.mark.parametrize("limit", [True, False])
def test_limiter_blocks_on_the_lagging_device_only_when_enabled(dist, adapter_name, limit):
    adapter = get_adapter(adapter_name)
    adapter_features.skip_unless(adapter, Feature.DEVICE_HANDLE)
    model, chain = wrapped_chain(
        adapter, dist.group, sharding_strategy="FULL_SHARD", limit_all_gathers=limit
    )
    device = LaggingDevice("strict")
    adapter.install_device_handle(model, device)
    model(chain.get_input(torch.device("cpu"), dist.rank)).sum().backward()
    if limit:
        assert device.blocking_syncs > 0 and device.completed > 0, device
    else:  # nothing else may synchronize: the device never catches up
        assert device.blocking_syncs == 0 and device.completed == 0, device


@pytest.mark.world_size(2)
def test_fsdp1_refuses_a_device_handle_after_the_first_forward(dist):
    adapter = get_adapter("torch-fsdp1")
    model, chain = wrapped_chain(adapter, dist.group)
    model(chain.get_input(torch.device("cpu"), dist.rank)).sum().backward()
    with pytest.raises(RuntimeError, match="before the first forward"):
        adapter.install_device_handle(model, LaggingDevice())


@pytest.mark.world_size(2)
def test_fsdp2_runs_on_the_lagging_device_without_ever_blocking(dist):
    # FSDP2 bounds memory by stream order, not by blocking the CPU: its events and streams are
    # the lagging device's, and nothing synchronizes on them.
    adapter = get_adapter("torch-fsdp2")
    model, chain = wrapped_chain(
        adapter, dist.group, sharding_strategy="FULL_SHARD", limit_all_gathers=True
    )
    device = LaggingDevice("strict")
    adapter.install_device_handle(model, device)
    model(chain.get_input(torch.device("cpu"), dist.rank)).sum().backward()
    context = model._get_fsdp_state()._comm_ctx
    assert context.device_handle is device
    assert context.all_gather_stream.device is device
    assert device.recorded > 0 and device.blocking_syncs == 0 and device.completed == 0, device
    with pytest.raises(RuntimeError, match="before the first forward"):
        adapter.install_device_handle(model, LaggingDevice())
