"""The torch FSDP1/FSDP2 facts behind the declared capabilities, re-measured on this host.

If a torch release lifts one of these limits, the test fails and the declaration in
torch_fsdp1.py / torch_fsdp2.py (and docs/adapters.md) must be updated.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_conformance.adapters import features as adapter_features
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


# ---------------------------------------------------------------- the precision.dtypes deviation
@pytest.mark.world_size(2)
def test_torch_fsdp1_accumulates_no_sync_gradients_in_param_dtype(dist):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision

    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = FSDP(nn.Linear(8, 8), device_id=torch.device("cpu"), mixed_precision=policy)
    with model.no_sync():
        for _ in range(2):
            model(torch.rand(4, 8)).sum().backward()
    (flat,) = model.parameters()
    # the unsharded gradient (both ranks' size), accumulated in param_dtype
    assert flat.grad.dtype == torch.bfloat16 and flat.grad.numel() == 2 * flat.numel()
    model(torch.rand(4, 8)).sum().backward()
    assert flat.grad.dtype == torch.float32 and flat.grad.shape == flat.shape


# ---------------------------------------------------------------- the fuzz.generated deviations
# The minimal reproductions of torch FSDP1's declared fuzz.generated deviations
# (adapters/torch_fsdp1.py, FSDP1_DEVIATIONS). Each test asserts the deviation is still there:
# when a torch release fixes one, its test fails and the declaration must go.


class _Branch(nn.Module):
    """``h + lin(h)`` in even steps, ``h`` (its parameters unused) in odd ones."""

    def __init__(self, frozen: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.lin.requires_grad_(not frozen)

    def forward(self, h: torch.Tensor, step: int) -> torch.Tensor:
        return h + self.lin(h) if step % 2 == 0 else h


class _WithBranch(nn.Module):
    def __init__(self, frozen: bool = False) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.b = _Branch(frozen)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        return self.b(self.pre(x), step)


def _fsdp1_with_branch(frozen: bool = False, **kwargs):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = _WithBranch(frozen)
    kwargs["device_id"] = torch.device("cpu")
    model.b = FSDP(model.b, **kwargs)
    return FSDP(model, **kwargs), model.b


@pytest.mark.world_size(2)
def test_torch_fsdp1_unused_instance_gets_grad_none(dist):
    root, inner = _fsdp1_with_branch()
    optimizer = torch.optim.SGD(root.parameters(), lr=0.01, momentum=0.9)
    for step in range(2):
        optimizer.zero_grad(set_to_none=False)
        root(torch.rand(1, 4), step).pow(2).mean().backward()
        grads = [param.grad for param in inner.parameters()]
        if step == 0:
            assert all(grad is not None for grad in grads)
        else:  # ran forward, none of its parameters used: None where DDP has zeros
            assert all(grad is None for grad in grads), grads
        optimizer.step()


@pytest.mark.world_size(2)
def test_torch_fsdp1_frozen_unused_instance_fails_in_backward(dist):
    root, _ = _fsdp1_with_branch(frozen=True)
    root(torch.rand(1, 4), 0).pow(2).mean().backward()
    with pytest.raises(ValueError, match="expected to be in states"):
        root(torch.rand(1, 4), 1).pow(2).mean().backward()


# what FSDP1 (NO_SHARD, use_orig_params=True) does once an inner instance skipped a forward,
# by release: 2.13.0 / 2.14.1 drop its parameters from named_parameters() silently; 2.15.0 fails
# the next backward that uses it in _use_sharded_grad_views ("... is a view and its base ... has
# been modified inplace"); 2.8.0 fails its next forward in _writeback_orig_params ("Cannot
# writeback when the parameter shape changes") -- FSDP1_DEVIATIONS declares all three
SKIPPED_INSTANCE_FAILURE = (
    r"is a view and its base or another view of its base has been modified inplace"
    r"|Cannot writeback when the parameter shape changes"
)


@pytest.mark.world_size(2)
def test_torch_fsdp1_no_shard_orig_params_vanish_after_a_skipped_forward(dist):
    import re

    from torch.distributed.fsdp import ShardingStrategy

    def inner_names(root):
        return sorted(name for name, _ in root.named_parameters() if ".lin." in name)

    def after_skipping(strategy) -> list[str]:
        """What each step after the skipped one shows: names visible, or the error."""
        root, _ = _fsdp1_with_branch(sharding_strategy=strategy, use_orig_params=True)
        root(torch.rand(1, 4), 0).sum().backward()
        assert len(inner_names(root)) == 2, strategy
        seen = []
        for step in (1, 2):  # skipped, then used again
            try:
                root(torch.rand(1, 4), step).sum().backward()
            except RuntimeError as error:
                seen.append(f"{type(error).__name__}: {error}")
                break
            seen.append(f"{len(inner_names(root))} names")
        return seen

    assert after_skipping(ShardingStrategy.FULL_SHARD) == ["2 names", "2 names"]
    seen = after_skipping(ShardingStrategy.NO_SHARD)
    vanished = "0 names" in seen
    failed = any(re.search(SKIPPED_INSTANCE_FAILURE, each) for each in seen)
    assert vanished or failed, (torch.__version__, seen)


def _branch_case(**config):
    """The generated form of ``_fsdp1_with_branch``: a wrapped branch used in step 0 only."""
    from fsdp_conformance.suite.fuzz.spec import Block, FuzzCase, ModelSpec, Program, Seq, Step

    body = Seq((Block("linear", 4, 4), Block("branch", 4, 4, period=3)))
    steps = Program(steps=(Step(), Step(), Step()))
    return FuzzCase(ModelSpec(4, body), ("body.nodes.1",), tuple(sorted(config.items())), steps)


@pytest.mark.world_size(2)
def test_fuzz_reports_the_none_gradient_as_its_own_failure(dist):
    """The fuzz comparison names FSDP1's None-versus-zero gradient (``NONE_GRADIENT``), which
    the deviation's envelope covers; the same case through impl is fine; the figure of a
    difference before that step (FSDP1 with the first loss changed) is another failure."""
    from fsdp_conformance.adapters import get_adapter
    from fsdp_conformance.adapters.deviations import find_deviation
    from fsdp_conformance.suite.fuzz import compare

    case = _branch_case(sharding_strategy="FULL_SHARD")
    fsdp1 = get_adapter("torch-fsdp1")
    root, model = compare.fsdp_wrap(fsdp1, case, dist)
    expected = compare.reference_run(case, dist)
    actual = compare.fsdp_train(fsdp1, root, model, case, dist)
    failure = compare.first_difference(case, actual, expected, dist.world_size)
    assert failure.failure == compare.NONE_GRADIENT, failure
    assert "after step 1's backward the FSDP parameters" in str(failure), failure
    assert find_deviation(fsdp1, "fuzz.generated", case, failure) is not None
    actual.values[0] = (actual.values[0][0], actual.values[0][1] + 1.0)  # differs before it
    failure = compare.first_difference(case, actual, expected, dist.world_size)
    assert failure.failure == "training differs from DDP's", failure
    assert find_deviation(fsdp1, "fuzz.generated", case, failure) is None
    assert compare.run_case(get_adapter("impl"), case, dist).kind == compare.OK


# ---------------------------------------------------------------- full state dicts and DCP
def _fsdp1_linear():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    return FSDP(nn.Linear(8, 5), device_id=torch.device("cpu"))


@pytest.mark.world_size(2)
def test_torch_fsdp1_full_state_dict_offload_to_cpu_fails_on_a_cpu_only_host(dist):
    """Before torch 2.14, FULL_STATE_DICT with offload_to_cpu=True fails on a CPU-only host
    (FSDP1_DEVIATIONS, state_dict.full; with rank0_only=True too, measured: rank 0 fails the same
    way); from 2.14 it works (`OFFLOAD_FAILS`); offload_to_cpu=False works, rank0_only=True
    included."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from fsdp_conformance.adapters.torch_fsdp1 import OFFLOAD_FAILS

    model = _fsdp1_linear()
    _step(model)
    for rank0_only in (False, True):
        config = FullStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            assert len(model.state_dict()) == (0 if rank0_only and dist.rank else 2)
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        if OFFLOAD_FAILS:
            with pytest.raises(RuntimeError, match=FSDP1_OFFLOAD_FAILURE):
                model.state_dict()
        else:
            state = model.state_dict()
            assert sorted(state) == ["bias", "weight"]
            assert all(value.device.type == "cpu" for value in state.values())


FSDP1_OFFLOAD_FAILURE = r"setStorage: .* out of bounds for storage of size 0"


@pytest.mark.world_size(2)
def test_torch_fsdp1_load_state_dict_assign_loads_nothing(dist):
    """FULL_STATE_DICT load_state_dict(assign=True) returns without an error but the flat
    parameter keeps its old values (FSDP1_DEVIATIONS, state_dict.full); assign=False loads."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    def loaded(assign: bool) -> dict:
        model = _fsdp1_linear()
        wanted = {"weight": torch.full((5, 8), 0.5), "bias": torch.full((5,), -1.0)}
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            model.load_state_dict(wanted, assign=assign)
        _step(model)  # the first forward / backward
        with FSDP.summon_full_params(model):
            params = model.module.named_parameters()
            return {name: bool((p == wanted[name]).all()) for name, p in params}

    assert loaded(assign=False) == {"weight": True, "bias": True}
    assert loaded(assign=True) == {"weight": False, "bias": False}


def test_fsdp1_checkpoints_only_where_dcp_passes_its_group():
    """[Note: DCP on a subgroup with FSDP1] (adapters/_dcp.py): torch-fsdp1 declares
    checkpoint_resume unsupported before torch 2.13 (measured: 2.8.0 hangs on a subgroup) and
    supported from 2.13 on (this torch's cells run)."""
    from fsdp_conformance.adapters import Feature, _dcp, get_adapter

    assert _dcp.fsdp1_group_dropped("2.8.0") and _dcp.fsdp1_group_dropped("2.12.1")
    for version in ("2.13.0", "2.14.1", "2.15.0"):
        assert not _dcp.fsdp1_group_dropped(version)
    reason = adapter_features.why_unsupported(get_adapter("torch-fsdp1"), Feature.CHECKPOINT_RESUME)
    assert (reason == _dcp.FSDP1_SUBGROUP_REASON) is _dcp.fsdp1_group_dropped(), reason


@pytest.mark.world_size(2)
@pytest.mark.fsdp_timeout(30)
def test_torch_fsdp1_optim_state_dict_fails_on_a_group_without_rank_0(dist):
    """FSDP.optim_state_dict on a process group without global rank 0 fails: it broadcasts
    from src=0 (a global rank) over the group (FSDP1_DEVIATIONS, state_dict.full)."""
    import torch.distributed as tdist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    solo = tdist.new_group([1])
    if dist.rank != 1:
        return
    model = FSDP(_model(), process_group=solo, device_id=torch.device("cpu"))
    optimizer = torch.optim.Adam(model.parameters())
    _step(model)
    optimizer.step()
    with pytest.raises(ValueError, match="Global rank 0 is not part of group"):
        FSDP.optim_state_dict(model, optimizer, group=solo)


@pytest.mark.world_size(2)
@pytest.mark.fsdp_timeout(30)
def test_this_torch_dcp_gives_fsdp1_its_subgroup(dist):
    """get_state_dict / set_state_dict on a model on a one-rank subgroup (the other rank
    outside it) finish on this torch: they pass FSDP1 its group (a hang is a FAIL at 30 s)."""
    import torch.distributed as tdist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from fsdp_conformance.adapters import _dcp

    if _dcp.fsdp1_group_dropped():
        pytest.skip("this torch drops FSDP1's group in DCP (it would hang): " + torch.__version__)
    solo = tdist.new_group([0])
    if dist.rank != 0:
        return
    model = FSDP(_model(), process_group=solo, device_id=torch.device("cpu"))
    optimizer = torch.optim.Adam(model.parameters())
    _step(model)
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


@pytest.mark.world_size(2)
def test_torch_fsdp2_clip_grad_norm_over_two_meshes_fails(dist):
    """torch-fsdp2's loops.clipping deviation: torch's clip_grad_norm_ (what FSDP2 users call)
    over parameters of a 1-D mesh and a 2-D (HSDP) mesh."""
    import torch.distributed as tdist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    alone = tdist.new_group([tdist.get_rank()], use_local_synchronization=True)
    ranks = tdist.get_process_group_ranks(dist.group)
    hsdp = DeviceMesh.from_group(
        [dist.group, alone],
        "cpu",
        mesh=torch.tensor(ranks).view(-1, 1),
        mesh_dim_names=("replicate", "shard"),
    )
    model = _model()
    fully_shard(model[0], mesh=hsdp)
    fully_shard(model, mesh=DeviceMesh.from_group(dist.group, "cpu"))
    _step(model)
    # the types the deviation declares: 2.13 raises a RuntimeError from the ValueError 2.8 raises
    with pytest.raises((RuntimeError, ValueError), match="must have the same mesh"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


@pytest.mark.world_size(2)
def test_torch_fsdp1_unties_a_parameter_shared_across_instances(dist):
    """torch-fsdp1's wrap.shared_across_instances deviation: each instance flattens its own copy
    of the tied weight, and one step unties them."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(12, 8), nn.Linear(8, 12)
            self.head.weight = self.embed.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(ids))

    torch.manual_seed(0)
    model = Tied()
    cpu = torch.device("cpu")
    model.embed = FSDP(model.embed, device_id=cpu)
    model.head = FSDP(model.head, device_id=cpu)
    root = FSDP(model, device_id=cpu)
    # 96 (embed's weight) + 96 (head's copy of it) + 12 (head's bias), 2 shards each
    assert sum(p.numel() for p in root.parameters()) * 2 == 96 + 96 + 12
    optimizer = torch.optim.SGD(root.parameters(), lr=0.1)
    ids = torch.randint(0, 12, (4,), generator=torch.Generator().manual_seed(dist.rank))
    root(ids).sum().backward()
    optimizer.step()
    with FSDP.summon_full_params(root):
        assert not torch.equal(model.embed.module.weight, model.head.module.weight)


@pytest.mark.world_size(2)
def test_torch_fsdp1_nested_instance_called_alone_stays_in_backward_post(dist):
    """torch-fsdp1's forward.other_method deviation (the nested instance called alone)."""
    from fsdp_conformance.adapters import get_adapter
    from fsdp_conformance.suite.training import build
    from fsdp_conformance.training_states import InstanceState

    adapter = get_adapter("torch-fsdp1")
    root, zoo_model = build(adapter, "loops", dist, {"sharding_strategy": "FULL_SHARD"})
    x = zoo_model.get_input(dist.device)[0]
    root(x).sum().backward()
    zoo_model.head(torch.rand(4, 16)).sum().backward()
    assert adapter.training_state(zoo_model.head) == InstanceState.BACKWARD_POST


def test_fsdp1_subgroup_deviation_applies_only_where_the_cell_checkpoints(monkeypatch):
    """The subgroup cell of state_dict.full reaches FSDP.optim_state_dict only through
    save_checkpoint, which runs only where torch-fsdp1 declares checkpoint_resume (DCP passes the
    group): on torch 2.8.0 the cell passes, and a deviation declared there turned that pass into
    a FAIL (found by benchmarks/compat_matrix.py)."""
    from fsdp_conformance.adapters import _dcp, deviations, get_adapter
    from fsdp_conformance.suite.test_state_dict import StateDictCase

    adapter = get_adapter("torch-fsdp1")
    for dropped in (False, True):
        monkeypatch.setattr(_dcp, "fsdp1_group_dropped", lambda dropped=dropped: dropped)
        last, first = (
            deviations.deviation_reason(adapter, "state_dict.full", StateDictCase("subgroup", m))
            for m in ("last", "first")
        )
        assert first is None
        assert (last is not None and "Global rank 0" in last) is not dropped, (dropped, last)
