"""The one training driver of the suite and the fuzzer: a model wrapped through an adapter
(FSDP) or the reference (DDP, or bare), each driven by the same step primitives (``Driver``:
zero_grad, forward, backward with the loss divisor, no_sync, clip, optimizer step, accumulation
boundary, full parameters, gradient shards, state-dict round trip, eval forward), and the
comparison of two runs (``assert_same_training``: torch's ``_test_identical_outputs``,
adapter-driven). The DDP reference of the parity checks is cached per rank process.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_conformance.adapters import Adapter, clean_param_name
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.checks import CheckFailure
from fsdp_conformance.models import CheckpointingWrap, DeviceInit, DummyDDP, move_after_wrap
from fsdp_conformance.observe.comm_trace import REDUCE_OPS, CommTrace

from . import zoo

STEPS = 3
LR = 0.01
MOMENTUM = 0.9
ADAM_LR = 1e-2
# the failures of a training comparison (``assert_same_training``)
TRAINING_DIFFERS = "training differs from DDP's"
NAMES_DIFFER = "parameter names differ from DDP's"

Phase = Callable[[int], contextlib.AbstractContextManager[Any]]


@dataclasses.dataclass(frozen=True)
class LoopCase:
    """The case a loop check's cell hands to ``Deviation.applies``."""

    model: str  # zoo model name
    sharding_strategy: str  # of every instance (the model may override one, e.g. NO_SHARD)
    # "no_sync" / "sync_every", "norm2" / "inf", "frozen", "inside" / "outside",
    # "unused_branch" / "two_forwards" / "eval_forward", ...
    variant: str


@dataclasses.dataclass
class TrainingResult:
    """What one training run produced."""

    losses: torch.Tensor  # (steps,) fp32
    # full parameters after the last step by the unwrapped model's names (tied: under each)
    params: dict[str, torch.Tensor]
    # per step, the gradients after backward: DDP's full ones or `Adapter.grad_shards`; None:
    # the adapter does not read them
    grads: list[dict[str, Any]] | None = None


def build(
    adapter: Adapter,
    model_name: str,
    dist: Any,
    config: dict[str, Any],
    *,
    device_init: str = "after",
    checkpointing: bool | str = False,
    group: Any = None,
    process_group: Any = None,
) -> tuple[nn.Module, nn.Module]:
    """The zoo model wrapped by `adapter` with `config`: (root, zoo model); skips when the
    adapter lacks a feature the config or the model needs. `checkpointing`: each wrapped block
    under activation checkpointing, "inside" (or True) or "outside" its instance; `group`: the
    model's (None: the test's); `process_group`: what the instances shard over if not `group`
    (a hybrid pair; both None: the default group)."""
    adapter_features.skip_unless(adapter, *zoo.MODELS[model_name].features)
    adapter_features.skip_unless(adapter, *adapter_features.wrap_features(**config))
    process_group = group if process_group is None else process_group
    wrap: Any = adapter.wrapper(process_group=process_group, **config)
    if checkpointing:
        wrap = CheckpointingWrap(wrap, outside=checkpointing == "outside")
    group = dist.group if group is None else group
    zoo_model = zoo.build(model_name, group, wrap, dist.device, device_init)
    root_config = {**config, **zoo_model.ROOT_WRAP_CONFIG}
    adapter_features.skip_unless(adapter, *adapter_features.wrap_features(**root_config))
    if DeviceInit(device_init) is DeviceInit.NEVER and dist.device.type != "cpu":
        root_config.setdefault("device_id", dist.device)  # the implementation moves it
    root = adapter.wrap(zoo_model, process_group=process_group, root=True, **root_config)
    return move_after_wrap(root, DeviceInit(device_init), dist.device), zoo_model


def micro_input(zoo_model: nn.Module, device: torch.device, index: int) -> tuple:
    """The zoo model's input made different per `index` (floats scaled, integer ids rolled;
    index 0: the input itself)."""
    return tuple(
        (t * (1.0 + 0.25 * index) if t.is_floating_point() else torch.roll(t, index, 0))
        if isinstance(t, torch.Tensor)
        else t
        for t in zoo_model.get_input(device)
    )


@dataclasses.dataclass
class Driver:
    """One model in training: FSDP through an adapter, or the reference (DDP or bare), through
    the same step primitives; `run` is the suite's loop of them, the fuzzer interprets its
    programs with them."""

    model: nn.Module  # the wrapped root, the DDP module or the bare model
    zoo_model: nn.Module  # the unwrapped model: get_input, get_loss, run_backward
    device: torch.device
    adapter: Adapter | None = None  # None: the reference
    optimizer_name: str = "sgd"  # "sgd" or "adam"; or assign `optimizer`

    @functools.cached_property
    def optimizer(self) -> torch.optim.Optimizer:
        adam = self.optimizer_name == "adam"
        options = {"lr": ADAM_LR} if adam else {"lr": LR, "momentum": MOMENTUM}
        if self.adapter is not None:
            return self.adapter.optimizer(self.model, self.optimizer_name, **options)
        return (torch.optim.Adam if adam else torch.optim.SGD)(self.model.parameters(), **options)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def loss(self, index: int) -> torch.Tensor:
        """The zoo model's loss of a forward of ``micro_input(index)``."""
        inputs = micro_input(self.zoo_model, self.device, index)
        return self.zoo_model.get_loss(inputs, self.model(*inputs))

    def backward(self, loss: torch.Tensor) -> None:
        """The zoo model's backward of `loss`: through ``adapter_backward`` (the loss divisor
        of summed reductions), or torch's for the reference."""
        if self.adapter is None:
            self.zoo_model.run_backward(loss)
        else:
            backward = functools.partial(adapter_backward, self.adapter, self.model)
            self.zoo_model.run_backward(loss, backward)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        if self.adapter is None:
            return self.model.no_sync()
        return self.adapter.no_sync(self.model)

    def clip(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The total gradient norm before clipping to `max_norm`."""
        if self.adapter is None:
            return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, norm_type)
        return self.adapter.clip_grad_norm_(self.model, max_norm, norm_type)

    def step(self) -> None:
        self.optimizer.step()

    def eval_forward(self, *inputs: Any) -> Any:
        with torch.no_grad():
            return self.model(*inputs)

    def round_trip(self) -> None:
        """Load the adapter's state dict back into the model (the reference's parameters are
        its state: nothing to do)."""
        if self.adapter is not None:
            self.adapter.load_state_dict(self.model, self.adapter.state_dict(self.model))

    def params(self) -> dict[str, torch.Tensor]:
        """Copies of the full parameters by the unwrapped model's names (tied: under each)."""
        if self.adapter is not None:
            return self.adapter.full_params(self.model)
        named = self.zoo_model.named_parameters(remove_duplicate=False)
        return {name: param.detach().clone() for name, param in named}

    def grads(self) -> dict[str, Any] | None:
        """Copies of the gradients after backward: the reference's full ones by name, or this
        rank's ``Adapter.grad_shards`` (None: the adapter does not read them)."""
        if self.adapter is None:
            named = self.zoo_model.named_parameters(remove_duplicate=False)
            return {name: p.grad.detach().clone() for name, p in named if p.grad is not None}
        shards = self.adapter.grad_shards(self.model)
        if shards is None:
            return None
        return {name: (start, values.clone()) for name, (start, values) in shards.items()}

    def accumulate(
        self, syncs: Sequence[bool], loss: Callable[[int], torch.Tensor], phase: Phase | None = None
    ) -> list[torch.Tensor]:
        """One optimizer step's micro-batches: micro-batch i's ``loss(i)`` divided by their
        number and run backward, inside ``no_sync`` unless ``syncs[i]`` and inside
        ``phase(i)``; with more than one, the adapter's ``accumulation_boundary`` before each.
        Returns the divided losses (fp32)."""
        count, losses = len(syncs), []
        for micro, sync in enumerate(syncs):
            if count > 1 and self.adapter is not None:
                self.adapter.accumulation_boundary(self.model, micro == count - 1)
            with contextlib.ExitStack() as contexts:
                if not sync:
                    contexts.enter_context(self.no_sync())
                if phase is not None:
                    contexts.enter_context(phase(micro))
                value = loss(micro)
                value = value / count if count > 1 else value
                self.backward(value)
            losses.append(value.detach().float())
        return losses

    def run(
        self,
        steps: int,
        *,
        start: int = 0,
        micro_batches: int = 1,
        sync_every: bool = True,
        same_input: bool = False,
        alternate_set_to_none: bool = False,
        phase: Callable[[int, int], contextlib.AbstractContextManager[Any]] | None = None,
        loss: Callable[[int, int], torch.Tensor] | None = None,
        after_backward: Callable[[int], None] | None = None,
        after_step: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """`steps` optimizer steps from `start` of `micro_batches` micro-batches (all but the
        last inside ``no_sync`` unless `sync_every`; inputs ``micro_input(index)``, index 0
        for all with `same_input`); returns every micro loss. ``zero_grad(set_to_none=True)``
        each step (`alternate_set_to_none`: in even steps only); `loss(step, index)` replaces
        ``self.loss(index)``; `phase(step, micro)` is a context manager around each
        micro-batch; the hooks get the step."""
        losses: list[torch.Tensor] = []
        syncs = [sync_every or micro == micro_batches - 1 for micro in range(micro_batches)]
        for step in range(start, start + steps):
            self.zero_grad(set_to_none=not alternate_set_to_none or step % 2 == 0)

            def micro_loss(micro: int, step: int = step) -> torch.Tensor:
                index = 0 if same_input else step * micro_batches + micro
                return self.loss(index) if loss is None else loss(step, index)

            step_phase = None if phase is None else functools.partial(phase, step)
            losses += self.accumulate(syncs, micro_loss, step_phase)
            if after_backward is not None:
                after_backward(step)
            self.step()
            if after_step is not None:
                after_step(step)
        return torch.stack(losses)

    def trained(self, steps: int = STEPS, **options: Any) -> TrainingResult:
        """`train`'s loop of `steps` steps (`options`: ``run``'s), with the gradients after
        every backward and the full parameters after the last step."""
        grads: list[Any] = []
        options.update(same_input=True, alternate_set_to_none=True)
        losses = self.run(steps, after_backward=lambda _: grads.append(self.grads()), **options)
        readable = all(g is not None for g in grads)
        return TrainingResult(losses, self.params(), grads if readable else None)


def train(
    model: nn.Module,
    zoo_model: nn.Module,
    device: torch.device,
    steps: int = STEPS,
    adapter: Adapter | None = None,
    **options: Any,
) -> torch.Tensor:
    """`steps` SGD+momentum steps of `model` (a wrapped `zoo_model`, DDP or bare): the parity
    checks' loop (the zoo model's own input every step, ``zero_grad`` alternating
    ``set_to_none``, True in step 0); the fp32 losses. `adapter`: the one that wrapped `model`
    (None: torch's optimizer and backward); `options`: ``Driver.run``'s hooks."""
    driver = Driver(model, zoo_model, device, adapter)
    return driver.run(steps, same_input=True, alternate_set_to_none=True, **options)


def adapter_backward(adapter: Adapter, model: nn.Module, loss: torch.Tensor) -> None:
    """Backward of `loss` through `adapter`. Under ``grad_reduction == "sum"`` the loss is
    divided by the root's group size and an instance on a group of another size (the MoE
    expert) has its gradients scaled by root size / own size (a hook: linear, so before or after
    the reduction alike): summed gradients then equal DDP's averaged ones."""
    if adapter.declarations.grad_reduction != "sum":
        adapter.backward(model, loss)
        return
    instances = adapter.instances(model)
    root_size = adapter.group_size(instances[0] if instances else model)
    handles = []
    for instance in instances[1:]:
        factor = root_size / adapter.group_size(instance)
        if factor != 1:
            for param in own_parameters(instances, instance):
                if param.requires_grad:
                    handles.append(param.register_hook(lambda grad, f=factor: grad * f))
    try:
        adapter.backward(model, loss / root_size)
    finally:
        for handle in handles:
            handle.remove()


def own_parameters(instances: list[nn.Module], instance: nn.Module) -> list[torch.Tensor]:
    """The parameters `instance` registers itself: in its tree, outside the other `instances`
    nested in it (flat parameters, DTensor shards, parametrization originals)."""
    nested = {id(other) for other in instances if other is not instance}
    params, stack = [], [instance]
    while stack:
        module = stack.pop()
        params.extend(p for p in module._parameters.values() if p is not None)
        stack.extend(child for child in module.children() if id(child) not in nested)
    return params


def fsdp_driver(
    adapter: Adapter, model_name: str, dist: Any, config: dict | None = None, **options: Any
) -> Driver:
    """``build``'s model in a Driver (`options`: ``build``'s, and ``optimizer_name``)."""
    name = options.pop("optimizer_name", "sgd")
    root, zoo_model = build(adapter, model_name, dist, config or {}, **options)
    return Driver(root, zoo_model, dist.device, adapter, name)


def ddp_driver(
    model_name: str, dist: Any, *, group: Any = None, ddp: bool = True, **options: Any
) -> Driver:
    """The unwrapped zoo model under DistributedDataParallel (DummyDDP for a model reducing its
    own gradients; bare with ``ddp=False``) in a Driver. `group`: the model's (None: the
    test's); `options`: ``optimizer_name``, and DDP's."""
    name = options.pop("optimizer_name", "sgd")
    group = dist.group if group is None else group
    zoo_model = zoo.build(model_name, group, None, dist.device).to(dist.device)
    model = zoo_model
    if ddp and zoo.MODELS[model_name].reference == "dummy_ddp":
        model = DummyDDP(zoo_model)
    elif ddp:
        model = nn.parallel.DistributedDataParallel(zoo_model, process_group=group, **options)
    return Driver(model, zoo_model, dist.device, optimizer_name=name)


def fsdp_run(
    adapter: Adapter, model_name: str, dist: Any, config: dict[str, Any], device_init: str = "after"
) -> TrainingResult:
    """The zoo model wrapped by `adapter` with `config`, trained ``STEPS`` steps."""
    return fsdp_driver(adapter, model_name, dist, config, device_init=device_init).trained()


# (model, rank, world size, device, steps) -> result; per rank process (and per rank thread)
_reference_cache: dict[tuple, TrainingResult] = {}


def reference_run(model_name: str, dist: Any, steps: int = STEPS) -> TrainingResult:
    """The unwrapped model trained under DDP (DummyDDP for self-reducing models), cached."""
    key = (model_name, dist.rank, dist.world_size, str(dist.device), steps)
    if key not in _reference_cache:
        _reference_cache[key] = ddp_driver(model_name, dist).trained(steps)
    return _reference_cache[key]


def assert_same_training(
    label: str,
    actual: TrainingResult,
    expected: TrainingResult,
    atol: float = 0.0,
    rtol: float = 0.0,
    loss_rtol: float | None = None,
    steps: int | None = None,
) -> None:
    """Equal losses, gradient shards and full parameters (bit-exact at tolerances 0); `label`
    names the run; `atol`, `rtol` hold for the losses too unless `loss_rtol` (absolute 0).
    Fails with ``CheckFailure`` "training differs from DDP's" and every gap
    (``training_gaps``), or "parameter names differ from DDP's"."""
    loss_atol, loss_rtol = (atol, rtol) if loss_rtol is None else (0.0, loss_rtol)
    if (names := names_failure(f"{label}: ", actual.params, expected.params)) is not None:
        raise names
    detail = f"FSDP losses {actual.losses.tolist()}, DDP losses {expected.losses.tolist()}"
    tol, loss_tol = tolerance_text(atol, rtol), tolerance_text(loss_atol, loss_rtol)
    try:
        if actual.losses.shape != expected.losses.shape:
            raise AssertionError(
                f"{label}: {len(actual.losses)} losses, DDP {len(expected.losses)}"
            )
        for step, (loss, reference) in enumerate(zip(actual.losses, expected.losses)):
            message = f"{label}: losses differ from DDP's at step {step} ({loss_tol})"
            assert_close(message, loss, reference, loss_atol, loss_rtol, detail=detail)
            if actual.grads is None or expected.grads is None:
                continue
            full = expected.grads[step]
            for name, (start, values) in actual.grads[step].items():
                if name not in full:
                    raise AssertionError(
                        f"{label}: after step {step}'s backward the FSDP run holds a gradient "
                        f"of {name!r}, DDP has none (DDP's: {sorted(full)})"
                    )
                end = start + values.numel()
                message = (
                    f"{label}: after step {step}'s backward, this rank's gradient shard of "
                    f"{name!r} (elements {start}..{end} of the flattened parameter) differs from "
                    f"DDP's gradient there ({tol})"
                )
                assert_close(message, values, full[name].reshape(-1)[start:end], atol, rtol)
        steps = len(expected.losses) if steps is None else steps
        for name, reference in expected.params.items():
            message = f"{label}: parameter {name!r} differs from DDP's after {steps} steps ({tol})"
            assert_close(message, actual.params[name], reference, atol, rtol)
    except AssertionError as error:
        gaps = training_gaps(actual, expected)
        raise CheckFailure(str(error), TRAINING_DIFFERS, **gaps) from None


def names_failure(label: str, actual: dict, expected: dict) -> CheckFailure | None:
    """``CheckFailure`` "parameter names differ from DDP's" (``missing``, ``unexpected``) unless
    ``actual`` has ``expected``'s names."""
    missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
    if not missing and not extra:
        return None
    message = (
        f"{label}full parameter names differ from DDP's: missing {missing}, unexpected {extra}"
    )
    return CheckFailure(
        message, NAMES_DIFFER, missing=", ".join(missing), unexpected=", ".join(extra)
    )


def training_gaps(actual: TrainingResult, expected: TrainingResult) -> dict[str, Any]:
    """The figure of "training differs from DDP's": the largest loss, gradient-shard (``inf``:
    a gradient DDP lacks) and parameter gap, and the parameter of the largest ("": none)."""
    grad_gaps = [0.0]
    for pieces, full in zip(actual.grads or (), expected.grads or ()):
        for name, (start, values) in pieces.items():
            piece = full[name].reshape(-1)[start : start + values.numel()] if name in full else None
            grad_gaps.append(max_gap(values, piece))
    param_gaps = {name: max_gap(actual.params[name], p) for name, p in expected.params.items()}
    parameter = max(param_gaps, key=param_gaps.__getitem__, default="")
    return {
        "loss_gap": max_gap(actual.losses, expected.losses),
        "grad_gap": max(grad_gaps),
        "param_gap": param_gaps.get(parameter, 0.0),
        "parameter": parameter if param_gaps.get(parameter) else "",
    }


def tolerance_text(atol: float, rtol: float) -> str:
    return "bit-exact" if atol == rtol == 0 else f"atol={atol:g}, rtol={rtol:g}"


def assert_close(
    message: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    atol: float,
    rtol: float,
    detail: str = "",
) -> None:
    """AssertionError ``message: max |difference| ...`` unless close (equal when both are 0)."""
    actual = actual.detach().float().cpu()
    expected = expected.detach().float().cpu()
    if actual.shape != expected.shape:
        raise AssertionError(f"{message}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if not torch.allclose(actual, expected, atol=atol, rtol=rtol):  # at 0, 0: torch.equal
        difference = (actual - expected).abs().max().item()
        raise AssertionError(
            f"{message}: max |difference| {difference:.3g}" + (f"; {detail}" if detail else "")
        )


def assert_trained(label: str, actual: tuple, expected: tuple, steps: int, tol: float = 0.0):
    """(losses, full parameters) after `steps` optimizer steps equal the reference's within
    `tol` (absolute and relative): ``assert_same_training``."""
    result, reference = TrainingResult(*actual), TrainingResult(*expected)
    assert_same_training(label, result, reference, tol, tol, steps=steps)


def assert_params(
    label: str, actual: dict, expected: dict, steps: int, atol: float = 0.0, rtol: float = 0.0
) -> None:
    """Full parameters after `steps` optimizer steps equal the reference's."""
    zeros = torch.zeros(steps)
    assert_same_training(
        label, TrainingResult(zeros, actual), TrainingResult(zeros, expected), atol, rtol
    )


def assert_losses(label: str, actual: torch.Tensor, expected: torch.Tensor, tol: float = 0.0):
    """Losses equal the reference's within `tol` (``assert_trained`` without parameters)."""
    assert_trained(label, (actual, {}), (expected, {}), len(expected), tol)


def by_clean_name(adapter: Adapter, named: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """`named`'s (name, value) pairs by the unwrapped model's names (wrapper segments cut)."""
    segments = adapter.declarations.wrapper_segments
    return {clean_param_name(name, segments): value for name, value in named}


def local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of this rank's registered parameters (of a DTensor: its local shard)."""
    return {
        name: (param.to_local() if hasattr(param, "to_local") else param).detach().clone()
        for name, param in model.named_parameters()
    }


def unsharded(adapter: Adapter, root: nn.Module, step: int, skip_root: bool = False) -> list[str]:
    """``step <step>: <module>`` for each instance of `root` holding unsharded parameters."""
    instances = adapter.instances(root)[1 if skip_root else 0 :]
    return [
        f"step {step}: {type(adapter.unwrap(instance)).__name__}"
        for instance in instances
        if adapter.is_unsharded(instance)
    ]


def trainable_labels(adapter: Adapter, root: nn.Module, trace: CommTrace) -> dict[str, bool]:
    """Instance label -> whether the instance's own parameters include a trainable one."""
    instances = adapter.instances(root)
    return {
        trace.labels[id(instance)]: any(
            p.requires_grad for p in own_parameters(instances, instance)
        )
        for instance in instances
    }


def events_per_label(trace: CommTrace, phase: str, ops: Any = REDUCE_OPS) -> dict[str, int]:
    """Instance label -> how many of `ops` (gradient reductions by default) it issued."""
    return dict(collections.Counter(event.label for event in trace.select(phase, ops)))


def parametrize(metafunc: pytest.Metafunc, **values: tuple[Any, ...]) -> None:
    """Parametrize each of `values`' fixture names the test takes, in the order given (the
    test id joins them in that order: ``loops-FULL_SHARD-no_sync``)."""
    for name, options in values.items():
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, [pytest.param(v, id=_id(v)) for v in options])


def _id(value: Any) -> str:
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"norm{value:g}"
    return getattr(value, "id", str(value))


def average_gradients(model: nn.Module, group: Any) -> None:
    """DDP's averaging by hand: each gradient divided by the world size, then summed."""
    import torch.distributed as dist

    for param in model.parameters():
        if param.grad is not None:
            param.grad.div_(group.size())
            dist.all_reduce(param.grad, group=group)


# [Note: tensor comparisons] the API families' comparisons of tensors, CheckFailure with the gap


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's ``full_tensor()`` (a collective), a plain tensor itself; detached."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return tensor.detach()


def full_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every registered parameter's full value by name (tied: under each name)."""
    named = model.named_parameters(remove_duplicate=False)
    return {name: full_tensor(param).clone() for name, param in named}


def max_gap(actual: Any, expected: Any) -> float:
    """max |actual - expected| in float64 (0 when empty; inf for a NaN, or when either is not a
    tensor or their shapes differ)."""
    tensors = isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)
    if not tensors or actual.shape != expected.shape:
        return math.inf
    if actual.numel() == 0:
        return 0.0
    difference = (actual.detach().cpu().double() - expected.detach().cpu().double()).abs()
    return math.inf if difference.isnan().any() else difference.max().item()


def check_gap(message: str, failure: str, actual: Any, expected: Any, tol: float = 0.0) -> None:
    """CheckFailure(`failure`, max_gap) ``<message> by <gap>`` when `actual` differs from
    `expected` by more than `tol` somewhere."""
    gap = max_gap(actual, expected)
    if gap > tol:
        raise CheckFailure(f"{message} by {gap:.3g}", failure, max_gap=gap)


def check_same_keys(label: str, failure: str, actual: Any, expected: Any) -> None:
    """`actual` has `expected`'s keys (CheckFailure with the missing and unexpected counts)."""
    missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
    if missing or extra:
        message = f"{label}: keys differ: missing {missing[:6]}, unexpected {extra[:6]}"
        raise CheckFailure(message, failure, missing=len(missing), unexpected=len(extra))


def check_same_values(
    label: str, failure: str, actual: dict, expected: dict, tol: float = 0.0
) -> None:
    """`actual` has `expected`'s keys (``check_same_keys``) and their tensors within `tol`
    (CheckFailure with the largest gap, the key holding it named)."""
    check_same_keys(label, failure, actual, expected)
    gaps = {key: max_gap(actual[key], value) for key, value in expected.items()}
    worst = max(gaps, key=gaps.__getitem__, default=None)
    if worst is not None and gaps[worst] > tol:
        count = f"{sum(gap > tol for gap in gaps.values())} of {len(gaps)} differ"
        message = f"{label}: {worst!r} differs from the reference by {gaps[worst]:.3g} ({count})"
        raise CheckFailure(message, failure, max_gap=gaps[worst])


def check_listed(label: str, failure: str, problems: list[str], **figures: Any) -> None:
    """CheckFailure(`failure`, offenders) listing `problems`, one a line (none: nothing)."""
    if problems:
        message = f"{failure}: {label}:\n  " + "\n  ".join(problems)
        raise CheckFailure(message, failure, offenders=len(problems), **figures)
