"""The zoo across ranks: MoE's own gradient reduction, and the transformer through every adapter."""
from __future__ import annotations

import pytest
import torch
from fsdp_conformance.models import DummyDDP, MixtureOfExperts, TransformerWithSharedParams
from torch import nn

from fsdp_conformance.adapters import BUILTIN_ADAPTERS, get_adapter
from fsdp_conformance.suite.training import train


def _gather(tensor: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(world_size)]
    torch.distributed.all_gather(out, tensor.contiguous())
    return out


# The built-in adapters with FSDP1-shaped instances (per-instance training states, a torch
# optimizer over model.parameters()); DeepSpeed (root states only, its engine owns the
# optimizer) is covered by tests/adapters/test_deepspeed.py and the suite's own checks
PER_INSTANCE_ADAPTERS = tuple(name for name in BUILTIN_ADAPTERS if name != "deepspeed")

@pytest.mark.world_size(2)
def test_moe_reference_averages_shared_grads_and_keeps_expert_grads_local(dist):
    model = MixtureOfExperts(dist.group, None)
    reference = DummyDDP(model)
    inputs = model.get_input(dist.device)
    model.run_backward(model.get_loss(inputs, reference(*inputs)))
    for name, param in model.named_parameters():
        grads = _gather(param.grad, dist.world_size)
        if getattr(param, "expert", False):
            if name.endswith("weight"):  # (the bias grad of a summed linear output is input-free)
                assert not torch.equal(grads[0], grads[1]), name
        else:
            assert torch.equal(grads[0], grads[1]), name


@pytest.mark.world_size(2)
@pytest.mark.parametrize("adapter_name", PER_INSTANCE_ADAPTERS)
def test_transformer_with_shared_params_matches_ddp_exactly(dist, adapter_name):
    adapter = get_adapter(adapter_name)
    reference = TransformerWithSharedParams(dist.group)
    reference_losses = train(nn.parallel.DistributedDataParallel(reference), reference,
                              dist.device, steps=2)
    model = TransformerWithSharedParams(dist.group, adapter.wrapper())
    root = adapter.wrap(model)
    assert len(adapter.instances(root)) == 5  # root + 2 encoder + 2 decoder layers
    losses = train(root, model, dist.device, steps=2)
    assert torch.equal(losses, reference_losses)
    full = adapter.full_params(root)
    tied = full["output_proj.weight"]
    assert torch.equal(tied, full["embed_tokens.weight"])  # still tied after two steps
    for name, param in reference.named_parameters(remove_duplicate=False):
        assert torch.equal(full[name], param.detach()), name
