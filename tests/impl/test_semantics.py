"""summon_full_params, state dicts, no_sync, training states, wrapping, prefetch traces."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from impl_testlib import (
    FlatSequential,
    NestedSequential,
    TiedTransformer,
    fsdp_run,
    reference_run,
    train,
)
from torch import nn

from fsdp_conformance.impl import (
    BackwardPrefetch,
    CPUOffload,
    FullyShardedDataParallel,
    HandleTrainingState,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
    TrainingState,
    trace,
)

# Process mode always: these tests patch classes and observe the process-global trace, and
# the models seed the global RNG (dropout), none of which is rank-local in thread mode.
pytestmark = pytest.mark.fsdp_mode("process")

FSDP = FullyShardedDataParallel


def wrapped(make, **config):
    def wrap(module, **overrides):
        return FSDP(module, **{**config, **overrides})

    return FSDP(make(wrap), **config)


@pytest.mark.world_size(2)
def test_summon_full_params_root_unshards_nested_and_writes_back(dist):
    reference = NestedSequential(dist.group, None).state_dict()
    model = wrapped(lambda w: NestedSequential(dist.group, w))
    inner_linear = model.module.module[1].module[0].module  # nested two levels down
    with model.summon_full_params():
        assert torch.equal(inner_linear.weight, reference["module.1.0.weight"])
        assert torch.equal(model.module.module[0].weight, reference["module.0.weight"])
        for instance in FSDP.fsdp_modules(model):
            instance._assert_state(TrainingState.SUMMON_FULL_PARAMS)
            instance._assert_state(HandleTrainingState.SUMMON_FULL_PARAMS)
        with torch.no_grad():
            inner_linear.weight.fill_(3.0)
    with model.summon_full_params(writeback=False, offload_to_cpu=True):
        assert torch.equal(inner_linear.weight, torch.full((16, 4), 3.0))
        with torch.no_grad():
            inner_linear.weight.fill_(5.0)  # discarded
    with model.summon_full_params(writeback=False, rank0_only=True):
        if dist.rank == 0:
            assert torch.equal(inner_linear.weight, torch.full((16, 4), 3.0))
    assert model.state_dict()["module.1.0.weight"].eq(3.0).all()
    for instance in FSDP.fsdp_modules(model):
        instance._assert_state(TrainingState.IDLE)


@pytest.mark.world_size(2)
def test_summon_registers_original_parameters(dist):
    reference = TiedTransformer(dist.group, None)
    expected = dict(reference.named_parameters(remove_duplicate=False))
    model = wrapped(lambda w: TiedTransformer(dist.group, w))
    sharded_names = [name for name, _ in model.named_parameters()]
    with model.summon_full_params(writeback=True):
        summoned = {
            name.replace("_fsdp_wrapped_module.", ""): param
            for name, param in model.named_parameters(remove_duplicate=False)
        }
        assert summoned.keys() == expected.keys()
        for name, param in summoned.items():
            assert isinstance(param, nn.Parameter) and torch.equal(param, expected[name]), name
        # a tied parameter is one object under each of its names
        assert len(list(model.parameters())) == len(list(reference.parameters()))
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1.0)
    assert [name for name, _ in model.named_parameters()] == sharded_names
    with model.summon_full_params(writeback=False):
        for name, param in model.named_parameters():
            name = name.replace("_fsdp_wrapped_module.", "")
            assert torch.equal(param, dict(reference.named_parameters())[name] + 1.0), name


@pytest.mark.world_size(2)
def test_summon_without_recurse_leaves_nested_sharded(dist):
    model = wrapped(lambda w: NestedSequential(dist.group, w))
    inner = model.module.module[2]
    with model.summon_full_params(recurse=False):
        inner._assert_state(TrainingState.IDLE)
        assert model.module.module[0].weight.shape == (4, 8)


@pytest.mark.world_size(2)
def test_full_and_sharded_state_dict_round_trip(dist):
    def make(w):
        return TiedTransformer(dist.group, w)

    original = TiedTransformer(dist.group, None).state_dict()
    model = wrapped(make)
    full = model.state_dict()
    assert list(full) == list(original)  # original names, original order
    assert all(torch.equal(full[k], original[k]) for k in original)
    train(model, steps=1)
    full = model.state_dict()
    sharded = model.state_dict(state_dict_type=StateDictType.SHARDED_STATE_DICT)
    assert "_flat_param" in sharded and "vocab_bias" in sharded
    assert "embed_tokens.weight" not in sharded

    fresh = wrapped(make)  # untrained
    assert not torch.equal(fresh.state_dict()["embed_tokens.weight"], full["embed_tokens.weight"])
    fresh.load_state_dict(sharded)
    reloaded = fresh.state_dict()
    assert all(torch.equal(reloaded[k], full[k]) for k in full)

    fresh = wrapped(make)
    fresh.load_state_dict(full)
    reloaded = fresh.state_dict()
    assert all(torch.equal(reloaded[k], full[k]) for k in full)
    # tied: one storage, so both names agree and training keeps them tied
    train(fresh, steps=1)
    after = fresh.state_dict()
    assert torch.equal(after["embed_tokens.weight"], after["output_proj.weight"])

    unwrapped = TiedTransformer(dist.group, None)
    unwrapped.load_state_dict(full)  # a full state dict loads into the plain module
    with pytest.raises(RuntimeError, match="missing keys.*unexpected keys"):
        fresh.load_state_dict({"nope": torch.zeros(1)})


@pytest.mark.world_size(2)
def test_no_sync_accumulates_then_reduces_like_ddp(dist):
    def make(w):
        return NestedSequential(dist.group, w)

    ddp = nn.parallel.DistributedDataParallel(make(None))
    model = wrapped(make)
    for net in (ddp, model):
        inputs = net.module.get_input(torch.device("cpu"))
        with net.no_sync():
            net(*inputs).sum().backward()
        if net is model:
            assert all(p.grad is None for p in model.parameters())  # nothing reduced yet
        net(*inputs).sum().backward()
    reference = {n: p.grad for n, p in ddp.module.named_parameters()}
    torch.optim.SGD(ddp.parameters(), lr=0.1).step()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    expected = ddp.module.state_dict()
    actual = model.state_dict()
    assert reference
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name
    with pytest.raises(RuntimeError, match="non-root"), model.module.module[2].no_sync():
        pass


@pytest.mark.world_size(2)
def test_training_states_follow_design(dist):
    """IDLE -> FORWARD -> IDLE -> BACKWARD_PRE -> BACKWARD_POST -> IDLE, root FORWARD_BACKWARD."""
    model = wrapped(lambda w: FlatSequential(dist.group, w))
    seen: dict[int, list] = {}
    instances = FSDP.fsdp_modules(model)

    def snapshot(*_):
        for index, instance in enumerate(instances):
            states = seen.setdefault(index, [])
            state = instance.handle_training_state
            if not states or states[-1] != state:
                states.append(state)

    for instance in instances[1:]:
        instance.module.register_forward_pre_hook(snapshot)
        instance.module.register_forward_hook(snapshot)
        instance.module.register_full_backward_hook(snapshot)
    with trace.observe(snapshot):
        output = model(torch.ones(2, 8))
        snapshot()
        assert model.is_root is True and instances[1].is_root is False
        model._assert_state(TrainingState.FORWARD_BACKWARD)
        output.sum().backward()
    snapshot()
    H = HandleTrainingState
    for index in range(1, len(instances)):
        states = seen[index][1:] if seen[index][0] == H.IDLE else seen[index]
        assert states == [H.FORWARD, H.IDLE, H.BACKWARD_PRE, H.BACKWARD_POST, H.IDLE], states
    for instance in instances:
        instance._assert_state(TrainingState.IDLE)
        assert not instance.is_unsharded
    with pytest.raises(AssertionError, match="expected to be in .*FORWARD_BACKWARD.* but is in"):
        model._assert_state([TrainingState.FORWARD_BACKWARD])


@pytest.mark.world_size(2)
def test_collective_counts_and_prefetch_trace(dist):
    """FULL_SHARD: forward AG = n, backward AG = n - 1 (root kept), RS = n; prefetches happen."""
    check_counts_and_prefetch(dist)


@pytest.mark.world_size(2)
def test_prefetch_check_catches_missing_prefetch(dist):
    from unittest import mock

    from fsdp_conformance.impl.exec_order import ExecOrder

    no_target = mock.patch.object(ExecOrder, "backward_prefetch_target", lambda self, i: None)
    with no_target, pytest.raises(AssertionError, match="backward prefetch never happened"):
        check_counts_and_prefetch(dist)


def check_counts_and_prefetch(dist):
    for config, backward_ag in [
        (dict(sharding_strategy=ShardingStrategy.FULL_SHARD), 4),
        (dict(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP), 0),
    ]:
        for backward_prefetch in [
            None,
            BackwardPrefetch.BACKWARD_PRE,
            BackwardPrefetch.BACKWARD_POST,
        ]:
            all_config = dict(config, backward_prefetch=backward_prefetch, forward_prefetch=True)
            inner = FlatSequential(dist.group, lambda m, **kw: FSDP(m, **all_config, **kw))
            inner.module.append(nn.Linear(8, 8))  # give the root its own parameters
            model = FSDP(inner, **all_config)
            for step in range(2):
                ops: list[tuple[str, object, dict]] = []
                with trace.observe(lambda op, inst, info: ops.append((op, inst, info))):
                    output = model(torch.ones(2, 8))
                    forward = [o for o in ops if o[0] == "all_gather"]
                    ops.clear()
                    output.sum().backward()
                backward = [o for o in ops if o[0] == "all_gather"]
                assert len(forward) == 5
                assert len(backward) == backward_ag, (config, backward_prefetch, backward)
                assert sum(o[0] == "reduce_scatter" for o in ops) == 5
                prefetches = [o for o in ops if o[0] == "prefetch"]
                if backward_prefetch is not None and backward_ag:
                    assert prefetches, "backward prefetch never happened"
                    assert {o[2]["direction"] for o in prefetches} == {
                        "backward_pre"
                        if backward_prefetch == BackwardPrefetch.BACKWARD_PRE
                        else "backward_post"
                    }
                    # every prefetch issues the target's all-gather right away
                    comm = [o for o in ops if o[0] != "rate_limiter_wait"]
                    for index, (op, _, info) in enumerate(comm):
                        if op == "prefetch":
                            assert comm[index + 1][0] == "all_gather"
                            assert comm[index + 1][1] is info["target"]
                else:
                    assert not prefetches


@pytest.mark.world_size(2)
def test_forward_prefetch_from_second_iteration(dist):
    model = wrapped(lambda w: FlatSequential(dist.group, w), forward_prefetch=True)
    for step in range(2):
        ops = []
        with trace.observe(lambda op, inst, info: ops.append((op, inst, info))):
            model(torch.ones(2, 8)).sum().backward()
        forward = [o for o in ops if o[0] == "prefetch" and o[2]["direction"] == "forward"]
        assert len(forward) == (0 if step == 0 else 3)  # order known after iteration 1


@pytest.mark.world_size(2)
def test_prefetch_of_unsharded_or_done_target_is_noop(dist):
    from fsdp_conformance.impl import runtime

    model = wrapped(lambda w: FlatSequential(dist.group, w), forward_prefetch=True)
    model(torch.ones(2, 8)).sum().backward()
    first, second = (model.module.module[i]._fsdp_state for i in (0, 1))
    output = model(torch.ones(2, 8))  # every non-root instance ran forward and resharded
    ops = []
    with trace.observe(lambda op, inst, info: ops.append(op)):
        runtime.prefetch(first, "forward")  # target already done this phase
        runtime.unshard(second)
        runtime.prefetch(first, "forward")  # target already unsharded
    assert ops.count("all_gather") == 1 and "prefetch" not in ops
    runtime.wait_unshard(second)
    output.sum().backward()


@pytest.mark.world_size(2)
def test_auto_wrap_policy_and_ignored_modules(dist):
    calls = []

    def policy(module, recurse, nonwrapped_numel):
        calls.append((type(module).__name__, recurse, nonwrapped_numel))
        return recurse or isinstance(module, nn.Linear)

    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.LayerNorm(4))
    ignored = inner[3]
    model = FSDP(inner, auto_wrap_policy=policy, ignored_modules=[ignored])
    instances = FSDP.fsdp_modules(model)
    assert (
        len(instances) == 3
        and isinstance(model.module[0], FSDP)
        and isinstance(model.module[2], FSDP)
    )
    assert ("Linear", False, 20) in calls
    names = [n for n, _ in model.named_parameters()]
    assert "module.3.weight" in " ".join(n.replace("_fsdp_wrapped_module", "module") for n in names)
    reference = copy.deepcopy(model.state_dict())
    train_step = torch.optim.SGD(model.parameters(), lr=0.1)
    (model(torch.ones(2, 4)) * torch.arange(4.0)).sum().backward()
    train_step.step()
    assert not torch.equal(model.state_dict()["0.weight"], reference["0.weight"])
    assert set(model.state_dict()) == set(reference)


@pytest.mark.world_size(2)
def test_cpu_offload_keeps_parameters_on_cpu_without_accelerator(dist):
    def make(w):
        return NestedSequential(dist.group, w)

    model = wrapped(make, cpu_offload=CPUOffload(offload_params=True))
    for param in model.parameters():
        assert param.device.type == "cpu" and not param.is_pinned()
    losses = train(model, steps=2)
    assert all(p.grad.device.type == "cpu" for p in model.parameters())
    assert torch.equal(torch.stack(losses), torch.stack(reference_run(make, steps=2)[0]))


@pytest.mark.world_size(2)
def test_eval_forward_without_grad_returns_to_idle(dist):
    model = wrapped(lambda w: NestedSequential(dist.group, w))
    with torch.no_grad():
        model(torch.ones(2, 8))
    for instance in FSDP.fsdp_modules(model):
        instance._assert_state(TrainingState.IDLE)
        assert not instance.is_unsharded
    model(torch.ones(2, 8)).sum().backward()


@pytest.mark.world_size(2)
@pytest.mark.parametrize("strategy", list(ShardingStrategy), ids=lambda s: s.name)
def test_a_dropped_model_is_freed(dist, strategy):
    # the old impl's grad hook (on a tensor its parameter views share, which the collector cannot
    # see into) held its state: every model, and the gloo threads of its groups, stayed alive
    model = wrapped(lambda w: NestedSequential(dist.group, w), sharding_strategy=strategy)
    model(torch.ones(2, 8)).sum().backward()
    instances = [weakref.ref(instance) for instance in FSDP.fsdp_modules(model)]
    del model
    gc.collect()
    assert [ref for ref in instances if ref() is not None] == []


class Checkpointed(nn.Module):
    """Two blocks run under non-reentrant activation checkpointing."""

    def __init__(self, group, wrap) -> None:
        super().__init__()
        self.rank = group.rank()
        w = wrap or (lambda m, **_: m)
        torch.manual_seed(0)
        self.first = w(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
        self.second = w(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        x = checkpoint(self.first, x, use_reentrant=False)
        return checkpoint(self.second, x, use_reentrant=False)

    def get_input(self, device):
        return (torch.rand(4, 8, generator=torch.Generator().manual_seed(self.rank)),)

    def get_loss(self, inputs, output):
        return output.pow(2).sum()

    def run_backward(self, loss):
        loss.backward()


@pytest.mark.world_size(2)
def test_activation_checkpoint_recompute_matches_ddp(dist):
    def make(w):
        return Checkpointed(dist.group, w)

    ref_losses, ref_state = reference_run(make)
    for strategy in ShardingStrategy:
        losses, state, _ = fsdp_run(make, sharding_strategy=strategy)
        assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), strategy
        for name, value in ref_state.items():
            assert torch.equal(state[name], value), (strategy, name)


@pytest.mark.world_size(2)
def test_divergent_execution_order_raises_on_every_rank(dist):
    model = wrapped(lambda w: FlatSequential(dist.group, w))
    layers = list(model.module.module)
    if dist.rank == 1:  # same modules, but rank 1's forward runs them in another order
        order = [layers[1], layers[0], *layers[2:]]

        def forward(x):
            for layer in order:
                x = layer(x)
            return x

        model.module.forward = forward
    with pytest.raises(RuntimeError, match="execution order differs across ranks.*rank 1 runs"):
        model(torch.ones(2, 8))


def prefetch_overlaps(dist) -> None:
    """A prefetched all-gather stays in flight while another instance works (async on CPU)."""
    model = wrapped(
        lambda w: FlatSequential(dist.group, w),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch=True,
    )
    for _ in range(2):
        ops = []
        with trace.observe(lambda op, inst, info, ops=ops: ops.append((op, inst, info))):
            model(torch.ones(2, 8)).sum().backward()
    prefetched = [
        i for i, (op, _, info) in enumerate(ops) if op == "all_gather" and info["prefetch"]
    ]
    assert prefetched
    for index in prefetched:
        target = ops[index][1]
        wait = next(
            j for j in range(index + 1, len(ops)) if ops[j][:2] == ("all_gather_wait", target)
        )
        between = {op for op, inst, _ in ops[index + 1 : wait] if inst is not target}
        assert between & {"free", "reduce_scatter", "all_gather_wait"}, (
            f"prefetched all-gather waited before any other work: {ops[index : wait + 1]}"
        )


@pytest.mark.world_size(2)
def test_prefetched_all_gather_is_waited_later(dist):
    prefetch_overlaps(dist)


@pytest.mark.world_size(2)
def test_overlap_check_catches_synchronous_all_gather(dist):
    from unittest import mock

    from fsdp_conformance.impl import comm

    original = comm.all_gather

    def synchronous(instance, output, shard, group, **info):
        work = original(instance, output, shard, group, **info)
        comm.wait_all_gather(instance, work)
        return work

    with mock.patch.object(comm, "all_gather", synchronous):
        with pytest.raises(AssertionError, match="waited before any other work"):
            prefetch_overlaps(dist)


@pytest.mark.world_size(1)
@pytest.mark.parametrize("param_dtype", [None, torch.float64], ids=["views", "copies"])
def test_module_moved_after_wrapping_computes_where_it_moved(dist, param_dtype):
    # model.to(device) after wrapping, before the first forward (the suite's device_init
    # 'after' on GPU ranks); the meta device stands in for the GPU on a CPU host
    mp = MixedPrecision(param_dtype=param_dtype) if param_dtype else None
    inner = FSDP(nn.Linear(4, 4), mixed_precision=mp)
    model = FSDP(nn.Sequential(inner, nn.Linear(4, 2)), mixed_precision=mp).to("meta")
    model(torch.ones(3, 4, device="meta")).sum().backward()
    assert {i.compute_device.type for i in FSDP.fsdp_modules(model)} == {"meta"}
    for param in model.parameters():  # the gradient reached the moved flat parameters
        assert param.device.type == "meta" and param.grad is not None


@pytest.mark.world_size(2)
def test_param_group_names_are_the_unwrapped_models(dist):
    """``optim.optimizer`` names each piece as the unwrapped model does, also for a parameter
    of a module wrapped directly (once ``0..weight`` for ``0.weight``)."""
    from fsdp_conformance.impl import optim

    model = FSDP(nn.Sequential(FSDP(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4))))
    names = []
    optim.optimizer(model, torch.optim.SGD, lambda name, param: names.append(name) or {}, lr=0.1)
    every_rank: list = [None] * 2
    torch.distributed.all_gather_object(every_rank, names)  # each rank names its own pieces
    assert set(every_rank[0] + every_rank[1]) == {"0.weight", "0.bias", "1.0.weight", "1.0.bias"}
