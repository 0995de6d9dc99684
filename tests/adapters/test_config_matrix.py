"""Every config key of the vocabulary, through every adapter, at world size 2 on CPU.

A supported key must wrap, train two steps and match DDP; an unsupported one skips with the
adapter's reason. Together with test_measured_torch_facts.py this is the evidence behind the
capability table in docs/adapters.md.
"""

from __future__ import annotations

import pytest
import torch
from fsdp_conformance.models import NestedWrappedModule
from torch import nn

from fsdp_conformance.adapters import ALWAYS_WRAP, BUILTIN_ADAPTERS, get_adapter
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.suite.training import train

CONFIGS = {
    "shard_grad_op": {"sharding_strategy": "SHARD_GRAD_OP"},
    "no_shard": {"sharding_strategy": "NO_SHARD"},
    "backward_prefetch_none": {"backward_prefetch": None},
    "backward_prefetch_post": {"backward_prefetch": "BACKWARD_POST"},
    "forward_prefetch": {"forward_prefetch": True},
    "limit_all_gathers_off": {"limit_all_gathers": False},
    "cpu_offload": {"cpu_offload": True},
    "mixed_precision_bf16": {"mixed_precision": {"param_dtype": torch.bfloat16}},
    "auto_wrap_always": {"auto_wrap_policy": ALWAYS_WRAP},
    "sync_module_states": {"sync_module_states": True},
}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("adapter_name", BUILTIN_ADAPTERS)
@pytest.mark.parametrize("config_id", list(CONFIGS))
def test_config_key_trains_like_ddp_or_skips(dist, adapter_name, config_id):
    adapter = get_adapter(adapter_name)
    config = CONFIGS[config_id]
    adapter_features.skip_unless(adapter, *adapter_features.wrap_features(**config))
    deviation = _declared_deviation(adapter, config)
    if deviation is None:
        _trains_like_ddp(dist, adapter, config)
        return
    # a deviation the adapter declares: the run must fail (else the declaration is stale)
    with pytest.raises(Exception) as failure:
        _trains_like_ddp(dist, adapter, config)
    pytest.xfail(f"{failure.value!r} -- known deviation: {deviation.reason}")


def _declared_deviation(adapter, config: dict):
    """The adapter's declared bf16 parity deviation covering every case, for `config`, or None."""
    if "mixed_precision" not in config:
        return None
    for deviation in adapter.declarations.known_deviations:
        if deviation.check == "parity.bf16" and deviation.applies is None:
            return deviation
    return None


def _trains_like_ddp(dist, adapter, config: dict) -> None:
    reference = NestedWrappedModule(dist.group)
    ddp = nn.parallel.DistributedDataParallel(reference)
    reference_losses = train(ddp, reference, dist.device, steps=2)

    inner_config = {k: v for k, v in config.items() if k != "auto_wrap_policy"}
    model = NestedWrappedModule(
        dist.group, None if "auto_wrap_policy" in config else adapter.wrapper(**inner_config)
    )
    root = adapter.wrap(model, root=True, **config)
    expected_instances = 8 if "auto_wrap_policy" in config else 4
    assert len(adapter.instances(root)) == expected_instances
    losses = train(root, model, dist.device, steps=2, adapter=adapter)  # its optimizer

    tolerance = 5e-2 if "mixed_precision" in config else 1e-6
    torch.testing.assert_close(losses, reference_losses, atol=tolerance, rtol=tolerance)
    full = adapter.full_params(root)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(
            full[name].float(),
            param.detach(),
            atol=tolerance,
            rtol=tolerance,
            msg=lambda message, name=name: f"{name}: {message}",
        )
