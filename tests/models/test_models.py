"""The zoo in one process: builds, runs, seeding, the wrap protocol, device init, real delays."""
from __future__ import annotations

import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
import torch
from fsdp_conformance.models import (
    ALWAYS_WRAP,
    AlwaysWrapNestedWrappedModule,
    DelayHooks,
    DeviceInit,
    DummyDDP,
    Layer,
    MixtureOfExperts,
    ModuleWithDelay,
    NestedWrappedModule,
    NestedWrappedModuleWithDelay,
    TransformerWithSharedParams,
    move_after_wrap,
    sleep_cycles,
    sleep_ms,
)
from torch import nn

CPU = torch.device("cpu")


class FakeGroup:
    """Just enough of a process group for building models without torch.distributed."""

    def __init__(self, rank: int = 0, size: int = 2) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class RecordingWrap:
    """A `wrap` that records what it was asked to wrap (and where the module was) and wraps in
    an identity container, plus DelayHooks that record their use."""

    def __init__(self) -> None:
        self.calls: list[tuple[nn.Module, dict, torch.device]] = []
        self.hook_calls: list[tuple] = []

    def __call__(self, module, **overrides):
        device = next(module.parameters()).device
        self.calls.append((module, overrides, device))
        return module

    @contextmanager
    def delay_before_reduction(self, delay):
        self.hook_calls.append(("reduction", delay))
        delay()
        yield

    @contextmanager
    def delay_before_free(self, instance, delay):
        self.hook_calls.append(("free", instance))
        delay()
        yield


def plain_wrap(module, **overrides):
    return module


SIMPLE_MODELS = [
    TransformerWithSharedParams,
    NestedWrappedModule,
    AlwaysWrapNestedWrappedModule,
    NestedWrappedModuleWithDelay,
]


@pytest.mark.parametrize("model_class", SIMPLE_MODELS)
def test_model_runs_forward_and_backward_unwrapped(model_class):
    model = model_class(FakeGroup())
    inputs = model.get_input(CPU)
    loss = model.get_loss(inputs, model(*inputs))
    assert loss.dim() == 0 and loss.dtype == torch.float32 and torch.isfinite(loss)
    model.run_backward(loss)
    assert all(param.grad is not None for param in model.parameters())


@pytest.mark.parametrize("model_class", [*SIMPLE_MODELS, MixtureOfExperts])
def test_parameters_are_identical_across_ranks_and_inputs_differ(model_class):
    rank0, rank1 = model_class(FakeGroup(0)), model_class(FakeGroup(1))
    again = model_class(FakeGroup(0))
    for (name, p0), (_, p1), (_, p_again) in zip(
        rank0.named_parameters(), rank1.named_parameters(), again.named_parameters(), strict=True
    ):
        assert torch.equal(p0, p_again), name  # deterministic
        if getattr(p0, "expert", False):
            assert not torch.equal(p0, p1), name  # experts differ per rank
        else:
            assert torch.equal(p0, p1), name
    assert not torch.equal(rank0.get_input(CPU)[0], rank1.get_input(CPU)[0])
    assert torch.equal(rank0.get_input(CPU)[0], rank0.get_input(CPU)[0])


@pytest.mark.parametrize("model_class", [*SIMPLE_MODELS, MixtureOfExperts])
def test_values_do_not_depend_on_the_global_rng(model_class):
    """Threaded ranks share the global generator: the zoo must not draw values from it."""
    torch.manual_seed(1)
    first = model_class(FakeGroup())
    torch.manual_seed(2)
    second = model_class(FakeGroup())
    pairs = zip(first.named_parameters(), second.named_parameters(), strict=True)
    for (name, p1), (_, p2) in pairs:
        assert torch.equal(p1, p2), name
    torch.manual_seed(3)
    assert torch.equal(first.get_input(CPU)[0], second.get_input(CPU)[0])


def test_transformer_ties_embedding_and_output_and_has_two_buffer_dtypes():
    model = TransformerWithSharedParams(FakeGroup())
    assert model.output_proj.weight is model.embed_tokens.weight
    assert model.vocab_bias.dtype == torch.float32 and model.long_buffer.dtype == torch.long
    assert isinstance(model.bn, nn.BatchNorm1d)
    assert isinstance(TransformerWithSharedParams(FakeGroup(), add_bn=False).bn, nn.Identity)
    src, tgt = model.get_input(CPU)
    assert src.shape == (6, 2) and tgt.shape == (4, 2)
    assert model(src, tgt).shape == (4, 2, 23)
    with pytest.raises(ValueError, match="d_vocab >= 12"):
        TransformerWithSharedParams(FakeGroup(), d_vocab=8)


def test_wrap_is_called_on_the_documented_submodules():
    wrap = RecordingWrap()
    NestedWrappedModule(FakeGroup(), wrap)
    shapes = [(type(m).__name__, getattr(m, "in_features", None)) for m, _, _ in wrap.calls]
    assert shapes == [("Linear", 4), ("Sequential", None), ("Linear", 16)]  # inner first

    wrap = RecordingWrap()
    NestedWrappedModule(FakeGroup(), wrap, wrap_everything=True)
    assert [m.in_features for m, _, _ in wrap.calls] == [8, 4, 16, 4]

    wrap = RecordingWrap()
    TransformerWithSharedParams(FakeGroup(), wrap)
    assert [type(m).__name__ for m, _, _ in wrap.calls] == ["TransformerEncoderLayer"] * 2 + [
        "TransformerDecoderLayer"
    ] * 2

    wrap = RecordingWrap()
    model = AlwaysWrapNestedWrappedModule(FakeGroup(), wrap)
    assert wrap.calls == [] and model.ROOT_WRAP_CONFIG == {"auto_wrap_policy": ALWAYS_WRAP}


def test_moe_wraps_expert_on_its_own_group_and_tags_expert_params():
    group, expert_group, wrap = FakeGroup(1), object(), RecordingWrap()
    model = MixtureOfExperts(group, wrap, expert_group=expert_group)
    (shared, shared_overrides, _), (expert, expert_overrides, _) = sorted(
        wrap.calls, key=lambda call: call[1]["process_group"] is expert_group
    )
    assert shared_overrides == {"process_group": group}
    assert expert_overrides == {"process_group": expert_group}
    assert expert is model.module[2] and shared is model.module[1]
    assert all(getattr(p, "expert", False) for p in expert.parameters())
    assert model.num_expert_params == 23 * 12 + 12
    assert sum(getattr(p, "expert", False) for p in model.parameters()) == 2


@pytest.mark.parametrize("device_init", list(DeviceInit))
def test_device_init_modes(device_init):
    meta = torch.device("meta")  # a second device that exists on every host
    wrap = RecordingWrap()
    model = NestedWrappedModule(FakeGroup(), wrap, device_init=device_init, device=meta)
    wrapped_on = {device.type for _, _, device in wrap.calls}
    assert wrapped_on == ({"meta"} if device_init is DeviceInit.BEFORE else {"cpu"})
    model = move_after_wrap(model, device_init, meta)
    final = {param.device.type for param in model.parameters()}
    assert final == ({"cpu"} if device_init is DeviceInit.NEVER else {"meta"})


def test_dummy_ddp_only_forwards():
    inner = NestedWrappedModule(FakeGroup())
    model = DummyDDP(inner)
    (x,) = inner.get_input(CPU)
    assert model.module is inner and torch.equal(model(x), inner(x))


# ---------------------------------------------------------------------------- delays


def _elapsed_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def test_sleep_really_delays_on_cpu(monkeypatch):
    assert _elapsed_ms(lambda: sleep_ms(60, CPU)) >= 59
    assert _elapsed_ms(lambda: sleep_cycles(40_000_000, "cpu")) >= 39  # nominal 1e6 cycles/ms
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    sleep_ms(0, CPU)
    sleep_cycles(0, CPU)
    assert slept == []  # zero means no delay at all


def test_delay_after_loss_really_delays_on_cpu(monkeypatch):
    fast = NestedWrappedModuleWithDelay(FakeGroup())
    slow = NestedWrappedModuleWithDelay(FakeGroup(), delay_after_loss_ms=80)
    inputs = fast.get_input(CPU)
    assert _elapsed_ms(lambda: slow.get_loss(inputs, slow(*inputs))) >= 79
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    fast.get_loss(inputs, fast(*inputs))
    slow.get_loss(inputs, slow(*inputs))
    assert slept == [0.08]  # only the delayed model sleeps, once, after its loss


def test_delay_before_reduction_goes_through_the_wrap_hook():
    wrap = RecordingWrap()
    model = NestedWrappedModuleWithDelay(FakeGroup(), wrap, delay_before_reduction_ms=50)
    inputs = model.get_input(CPU)
    loss = model.get_loss(inputs, model(*inputs))
    assert _elapsed_ms(lambda: model.run_backward(loss)) >= 49  # the hook called the delay once
    assert [kind for kind, _ in wrap.hook_calls] == ["reduction"]


def test_moe_delay_before_free_goes_through_the_wrap_hook():
    wrap = RecordingWrap()
    model = MixtureOfExperts(FakeGroup(), wrap, delay_before_free_ms=50, expert_group=object())
    (x,) = model.get_input(CPU)
    assert _elapsed_ms(lambda: model(x)) >= 49
    assert wrap.hook_calls == [("free", model.module[2])]


def test_delays_without_a_hook_are_a_clear_error():
    assert not isinstance(plain_wrap, DelayHooks) and isinstance(RecordingWrap(), DelayHooks)
    with pytest.raises(TypeError, match=r"delay_before_reduction\(delay\).*adapter\.wrapper"):
        NestedWrappedModuleWithDelay(FakeGroup(), plain_wrap, delay_before_reduction_ms=1)
    with pytest.raises(TypeError, match=r"delay_before_free\(instance, delay\)"):
        MixtureOfExperts(FakeGroup(), plain_wrap, delay_before_free_ms=1, expert_group=object())
    # unwrapped reference: nothing to delay, no error
    ModuleWithDelay(NestedWrappedModule(FakeGroup()), delay_before_reduction_ms=1)


def test_layer_computes_for_its_cycles_and_owns_an_optional_param():
    layer = Layer(compute_cycles=30_000_000, has_params=True)  # 30 ms at the nominal CPU clock
    x = torch.zeros(2)
    elapsed = _elapsed_ms(lambda: layer(x))
    assert elapsed >= 29 and 29 <= layer.get_time() <= elapsed + 1
    assert torch.equal(layer(x), torch.full((2,), 0.5))
    assert list(Layer(0, has_params=False).parameters()) == []
    with pytest.raises(RuntimeError, match="before any forward"):
        Layer(0, has_params=False).get_time()


def test_importing_the_zoo_imports_no_fsdp_implementation():
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import fsdp_conformance.models\n"
        "bad = [m for m in set(sys.modules) - before if m.startswith(('torch.distributed.fsdp', "
        "'fsdp_conformance.impl', 'fsdp_conformance.adapters', 'torch.testing._internal'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
