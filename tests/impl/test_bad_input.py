"""Each misuse raises a clear error (naming the problem and the fix) and never hangs.

Errors that need no collective are triggered on rank 0 only: if the check ran after a
collective, rank 0 would hang and the harness timeout would fail the test.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_conformance.impl import FullyShardedDataParallel as FSDP
from fsdp_conformance.impl import MixedPrecision, ShardedFlatParameter, StateDictType

# Process mode always: these tests patch classes and observe the process-global trace, and
# the models seed the global RNG (dropout), none of which is rank-local in thread mode.
pytestmark = pytest.mark.fsdp_mode("process")


@pytest.mark.world_size(2)
def test_wrapping_a_module_twice(dist):
    if dist.rank == 0:
        linear = nn.Linear(4, 4)
        wrapped = FSDP(linear)
        with pytest.raises(ValueError, match="already a FullyShardedDataParallel instance"):
            FSDP(wrapped)
        with pytest.raises(ValueError, match="already wrapped by another FullyShardedDataParallel"):
            FSDP(linear)


@pytest.mark.world_size(2)
def test_wrapping_the_parent_after_the_child_ran(dist):
    child = FSDP(nn.Linear(4, 4))
    child(torch.ones(2, 4)).sum().backward()
    if dist.rank == 0:
        with pytest.raises(ValueError, match="already ran forward.*construct the outer FSDP"):
            FSDP(nn.Sequential(child, nn.Linear(4, 4)))


@pytest.mark.world_size(2)
def test_parameters_on_mixed_devices(dist):
    if dist.rank == 0:
        module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta"))
        with pytest.raises(ValueError, match=r"mixed devices: cpu .*'0\.weight'.*meta.*module\.to"):
            FSDP(module)


@pytest.mark.world_size(2)
def test_forward_inside_summon_full_params(dist):
    model = FSDP(nn.Sequential(FSDP(nn.Linear(4, 4)), nn.Linear(4, 4)))
    model(torch.ones(2, 4)).sum().backward()
    with model.summon_full_params():
        with pytest.raises(RuntimeError, match="inside summon_full_params; exit"):
            model(torch.ones(2, 4))
        inner = model.module[0]
        with pytest.raises(RuntimeError, match="inside summon_full_params; exit"):
            inner(torch.ones(2, 4))


@pytest.mark.world_size(2)
def test_summon_full_params_during_forward_and_backward(dist):
    model = FSDP(nn.Sequential(FSDP(nn.Linear(4, 4)), nn.Linear(4, 4)))
    errors = []

    def summon(*_):
        try:
            with model.summon_full_params():
                pass
        except RuntimeError as error:
            errors.append(str(error))

    handle = model.module[1].register_forward_hook(summon)
    output = model(torch.ones(2, 4))
    handle.remove()
    output.register_hook(summon)
    output.sum().backward()
    assert len(errors) == 2, errors
    for message in errors:
        assert "is in FORWARD_BACKWARD; call it outside forward/backward" in message


@pytest.mark.world_size(2)
def test_sharded_state_dict_with_wrong_world_size(dist):
    model = FSDP(nn.Linear(4, 4))
    state = model.state_dict(state_dict_type=StateDictType.SHARDED_STATE_DICT)
    entry = state["_flat_param"]
    state["_flat_param"] = ShardedFlatParameter(entry.shard, entry.rank, 4, entry.unpadded_numel)
    if dist.rank == 0:
        with pytest.raises(
            ValueError, match="saved with world size 4 .* size 2; load a full state"
        ):
            model.load_state_dict(state)
    before = model.flat_param.detach().clone()
    assert torch.equal(model.flat_param, before)  # nothing was loaded


@pytest.mark.world_size(2)
def test_sync_module_states_with_different_shapes(dist):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4 + dist.rank))
    with pytest.raises(
        ValueError, match=r"'1\.weight' is \(4, 4\) .* on rank 0 but \(5, 4\) .* on rank 1"
    ):
        FSDP(module, sync_module_states=True)


@pytest.mark.world_size(2)
def test_sync_module_states_broadcasts_rank0(dist):
    torch.manual_seed(dist.rank)  # different weights per rank
    model = FSDP(nn.Linear(4, 4), sync_module_states=True)
    state = model.state_dict()
    gathered = [torch.empty_like(state["weight"]) for _ in range(2)]
    torch.distributed.all_gather(gathered, state["weight"])
    assert torch.equal(gathered[0], gathered[1])


@pytest.mark.world_size(2)
def test_misconfiguration_errors(dist):
    if dist.rank == 0:
        with pytest.raises(TypeError, match="sharding_strategy must be a ShardingStrategy"):
            FSDP(nn.Linear(2, 2), sharding_strategy="FULL_SHARD")
        # frozen and trainable parameters in one instance: the frozen ones stay unflattened
        module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        module[0].weight.requires_grad_(False)
        mixed = FSDP(module)
        assert mixed.module[0].weight.requires_grad is False
        assert mixed._fsdp_state.handle.numel == 2 + 4 + 2  # bias 0, weight and bias 1
        # ... and so are not cast: a param_dtype for such an instance is refused
        module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        module[0].weight.requires_grad_(False)
        with pytest.raises(ValueError, match="wrap the frozen submodules in their own FSDP"):
            FSDP(module, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
        model = FSDP(nn.Linear(2, 2))
        with pytest.raises(ValueError, match="rank0_only=True, writeback=True"):
            with model.summon_full_params(rank0_only=True):
                pass
