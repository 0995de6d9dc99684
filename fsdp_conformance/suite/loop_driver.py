"""The shared driver of the loop checks (test_loops.py, test_forward.py, test_optim.py, ...):
build a zoo model wrapped or under DDP, run it (``Driver``), feed it (``micro_input``), train
it (``steps_from``, ``accumulate_steps``) and compare (``assert_losses``, ``assert_params``).

[Note: loop tolerances]
Parity is bit-exact (fp32, world size 2) wherever the FSDP run does the same arithmetic as DDP
in the same order: accumulation under no_sync (each micro-batch's gradient is added locally in
the same order, and the one reduction averages the sum; DDP's no_sync does the same), frozen
parameters, activation checkpointing (the recompute repeats the same forward), forward variants
and checkpoint/resume (Adam is elementwise; a load restores the exact bits). Measured bit-exact on
torch 2.13.0 for impl, torch FSDP1 and torch FSDP2. Clipping is the exception: the global norm
sums squares in another order (per shard, then across ranks; impl in float64), so the total norm
differs from DDP's by a few ulps, and so does the clip coefficient ``max_norm / (norm + 1e-6)``
that scales every gradient. The norm is compared with ``rtol = 1e-5`` (float32 summation of a
few hundred squares: error below ``n * eps ~ 300 * 6e-8 = 2e-5`` worst case, ~1e-6 typical),
and parameters after ``CLIP_STEPS`` SGD steps with ``atol = rtol = 1e-5``: each step moves a
parameter by at most ``lr * max_norm`` = 0.01, and a relative error of 1e-5 in the coefficient
moves it by 1e-7 per step; momentum (0.9) adds up to 10 steps' worth. Measured max differences:
in the docstring of ``BaseGradientClippingTests``. Accumulation with synchronisation on every
micro-batch is not bit-exact either: DDP all-reduces the gradient accumulated so far (local sum
of the micro-batches, then averaged), FSDP reduces each micro-batch's gradient and adds the
averaged results; ``atol = rtol = 1e-6`` (a few float32 ulps of gradients of order 1; measured
max difference 3.5e-10 on ``nested`` after 2 steps, impl). Two forwards before one backward get
the same tolerance: an implementation that reduces once per parameter access (SimpleFSDP's
all-gather in a parametrization, whose backward reduce-scatters) reduces each forward's
gradient and adds the two results, where DDP reduces their sum -- one float32 addition in
another order per element per step, so the parameters after 4 steps differ by at most a few
ulps of the gradient times ``lr`` and momentum's ``1 / (1 - 0.9)``: far below 1e-6 (impl, FSDP1
and FSDP2 reduce once and stay bit-exact).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.adapters import loop as adapter_loop
from fsdp_conformance.models import (
    CheckpointingWrap,
    DeviceInit,
    move_after_wrap,
)
from fsdp_conformance.observe.comm_trace import REDUCE_OPS, CommTrace

from . import training, zoo

LR = training.LR
MOMENTUM = training.MOMENTUM
ADAM_LR = 1e-2
# see [Note: loop tolerances]
CLIP_NORM_RTOL = 1e-5
CLIP_PARAM_TOL = 1e-5
CLIP_STEPS = 3
SYNC_EVERY_TOL = 1e-6
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP")


@dataclasses.dataclass(frozen=True)
class LoopCase:
    """The case a loop check's cell hands to ``Deviation.applies``."""

    # zoo model name (suite/zoo.py)
    model: str
    # sharding strategy of every instance (the model may override one, e.g. NO_SHARD)
    sharding_strategy: str
    # the variant: "no_sync" / "sync_every", "norm2" / "inf", "frozen", "inside" /
    # "outside" (activation checkpointing), "unused_branch" / "two_forwards" / "eval_forward"
    variant: str


# ---------------------------------------------------------------------------- building
def build(
    adapter: Any,
    model_name: str,
    dist: Any,
    config: dict[str, Any],
    *,
    checkpointing: bool | str = False,
    group: Any = None,
    process_group: Any = None,
) -> tuple[nn.Module, nn.Module]:
    """The zoo model wrapped by `adapter` (root and zoo model); skips on a missing feature.

    Args:
        checkpointing: each wrapped block runs under non-reentrant activation checkpointing
            ("inside" or True: inside the FSDP instance; "outside": around it).
        group: the process group (None: the test's).
        process_group: what the instances shard over when not `group` (a hybrid strategy's
            (shard_group, replicate_group) pair).
    """
    spec = zoo.MODELS[model_name]
    adapter_features.skip_unless(adapter, *spec.features)
    adapter_features.skip_unless(adapter, *adapter_features.wrap_features(adapter, **config))
    group = dist.group if group is None else group
    process_group = group if process_group is None else process_group
    wrap: Any = adapter.wrapper(process_group=process_group, **config)
    if checkpointing:
        wrap = CheckpointingWrap(wrap, outside=checkpointing == "outside")
    zoo_model = zoo.build(model_name, group, wrap, dist.device)
    root_config = {**config, **zoo_model.ROOT_WRAP_CONFIG}
    root = adapter.wrap(zoo_model, process_group=process_group, root=True, **root_config)
    return move_after_wrap(root, DeviceInit.AFTER, dist.device), zoo_model


def build_reference(
    model_name: str, dist: Any, *, group: Any = None, ddp: bool = True, **ddp_options: Any
) -> tuple[nn.Module, nn.Module]:
    """The unwrapped zoo model under DistributedDataParallel (or bare with ``ddp=False``)."""
    group = dist.group if group is None else group
    model = zoo.build(model_name, group, None, dist.device)
    model.to(dist.device)
    if not ddp:
        return model, model
    return nn.parallel.DistributedDataParallel(model, process_group=group, **ddp_options), model


def micro_input(zoo_model: nn.Module, device: torch.device, index: int) -> tuple:
    """The zoo model's input, made different per micro-batch `index` (floats scaled, integer
    ids rolled), the same on every run."""
    inputs = zoo_model.get_input(device)
    return tuple(
        (t * (1.0 + 0.25 * index) if t.is_floating_point() else torch.roll(t, index, 0))
        if isinstance(t, torch.Tensor)
        else t
        for t in inputs
    )


def fsdp_optimizer(adapter: Any, root: nn.Module, name: str = "sgd") -> torch.optim.Optimizer:
    if name == "adam":
        return adapter_loop.optimizer(adapter, root, "adam", lr=ADAM_LR)
    return adapter_loop.optimizer(adapter, root, "sgd", lr=LR, momentum=MOMENTUM)


def ddp_optimizer(model: nn.Module, name: str = "sgd") -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=ADAM_LR)
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


@dataclasses.dataclass
class Driver:
    """How one loop runs a model: FSDP through an adapter, or the DDP reference."""

    model: nn.Module  # the wrapped root, or the DDP module
    zoo_model: nn.Module
    adapter: Any = None  # None: the DDP reference

    def backward(self, loss: torch.Tensor) -> None:
        if self.adapter is None:
            self.zoo_model.run_backward(loss)
        else:
            self.zoo_model.run_backward(
                loss, lambda value: training.adapter_backward(self.adapter, self.model, value)
            )

    def accumulation_boundary(self, boundary: bool) -> None:
        if self.adapter is not None:
            adapter_loop.accumulation_boundary(self.adapter, self.model, boundary)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        if self.adapter is None:
            return self.model.no_sync()
        return adapter_loop.no_sync(self.adapter, self.model)

    def clip(self, max_norm: float, norm_type: float) -> torch.Tensor:
        if self.adapter is None:
            return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, norm_type)
        return adapter_loop.clip_grad_norm_(self.adapter, self.model, max_norm, norm_type)

    def params(self) -> dict[str, torch.Tensor]:
        if self.adapter is None:
            return {
                name: param.detach().clone()
                for name, param in self.zoo_model.named_parameters(remove_duplicate=False)
            }
        return adapter_loop.full_params(self.adapter, self.model)


def accumulate_steps(
    driver: Driver,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    steps: int,
    micro_batches: int,
    sync_every: bool,
    trace: CommTrace | None = None,
    same_input: bool = False,
) -> torch.Tensor:
    """`steps` optimizer steps of `micro_batches` micro-batches each (loss / micro_batches);
    without ``sync_every`` all but the last run inside ``no_sync``; with ``same_input`` every
    micro-batch of a step gets the step's input. Returns every micro loss."""
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(micro_batches):
            synchronise = sync_every or micro == micro_batches - 1
            if micro_batches > 1:
                driver.accumulation_boundary(micro == micro_batches - 1)
            context = contextlib.nullcontext() if synchronise else driver.no_sync()
            phase = trace.phase(f"step {step} micro {micro}") if trace else None
            with context, phase or contextlib.nullcontext():
                index = step * micro_batches + (0 if same_input else micro)
                inputs = micro_input(driver.zoo_model, device, index)
                loss = driver.zoo_model.get_loss(inputs, driver.model(*inputs)) / micro_batches
                driver.backward(loss)
            losses.append(loss.detach().float())
        optimizer.step()
    return torch.stack(losses)


def trainable_labels(adapter: Any, root: nn.Module, trace: CommTrace) -> dict[str, bool]:
    """Instance label -> whether the instance manages a parameter that requires a gradient
    (its own registered parameters: flat parameters, or FSDP2's DTensors)."""
    instances = adapter.instances(root)
    return {
        trace.labels[id(instance)]: any(
            p.requires_grad for p in training.own_parameters(instances, instance)
        )
        for instance in instances
    }


def reductions_per_label(trace: CommTrace, phase: str, ops: Any = REDUCE_OPS) -> dict[str, int]:
    """Instance label -> how many of `ops` (gradient reductions by default) it issued."""
    counts: dict[str, int] = {}
    for event in trace.select(phase, ops):
        counts[event.label] = counts.get(event.label, 0) + 1
    return counts


def assert_params(
    label: str, actual: dict, expected: dict, steps: int, atol: float = 0.0, rtol: float = 0.0
) -> None:
    """Full parameters after `steps` optimizer steps equal the reference's."""
    training.assert_same_training(
        label,
        training.TrainingResult(torch.zeros(steps), actual),
        training.TrainingResult(torch.zeros(steps), expected),
        atol,
        rtol,
    )


def assert_losses(label: str, actual: torch.Tensor, expected: torch.Tensor, tol: float = 0.0):
    training._assert_close(
        f"{label}: losses differ from DDP's ({training._tolerance(tol, tol)})",
        actual,
        expected,
        tol,
        tol,
        detail=f"FSDP losses {actual.tolist()}, DDP losses {expected.tolist()}",
    )


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


def steps_from(
    driver: Driver, optimizer: Any, device: torch.device, start: int, count: int
) -> torch.Tensor:
    """`count` optimizer steps, one input each (``micro_input`` from `start` on); the losses."""
    losses = []
    for step in range(start, start + count):
        optimizer.zero_grad()
        inputs = micro_input(driver.zoo_model, device, step)
        loss = driver.zoo_model.get_loss(inputs, driver.model(*inputs))
        driver.backward(loss)
        optimizer.step()
        losses.append(loss.detach().float())
    return torch.stack(losses)


def average_gradients(model: nn.Module, group: Any) -> None:
    """DDP's averaging by hand: each gradient divided by the world size, then summed."""
    import torch.distributed as dist

    for param in model.parameters():
        if param.grad is not None:
            param.grad.div_(group.size())
            dist.all_reduce(param.grad, group=group)
