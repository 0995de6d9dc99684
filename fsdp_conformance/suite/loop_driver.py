"""The loop checks' driver: a zoo model wrapped or under DDP (``fsdp_driver``,
``ddp_driver``), trained (``Driver.run``) and compared (``assert_losses``, ``assert_params``).

[Note: loop tolerances]
Parity is bit-exact (fp32, world size 2) wherever FSDP does DDP's arithmetic in DDP's order:
accumulation under no_sync (one reduction of the local sum, as DDP's no_sync), frozen
parameters, activation checkpointing, forward variants, checkpoint/resume (measured on torch
2.13.0 for impl, torch FSDP1 and FSDP2). Clipping is not: the global norm sums squares in
another order (per shard, then across ranks), so the norm and the clip coefficient differ from
DDP's by a few ulps. Norms are compared with ``rtol = 1e-5`` (float32 sum of a few hundred
squares: at most ~2e-5, typically ~1e-6), parameters after ``CLIP_STEPS`` SGD steps with
``atol = rtol = 1e-5`` (a step moves a parameter by at most ``lr * max_norm`` = 0.01; momentum
adds up to 10 steps' worth). Synchronising every micro-batch is not bit-exact either: DDP
reduces the accumulated sum, FSDP each micro-batch's gradient and adds the averages: ``atol =
rtol = 1e-6`` (measured 3.5e-10). Two forwards before one backward get the same tolerance: an
implementation reducing once per parameter access (SimpleFSDP) adds two reduced gradients
where DDP reduces their sum.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_conformance.adapters import clean_param_name
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.models import CheckpointingWrap, DeviceInit, move_after_wrap
from fsdp_conformance.observe.comm_trace import REDUCE_OPS, CommTrace

from . import training, zoo

ADAM_LR = 1e-2
CLIP_NORM_RTOL = 1e-5  # [Note: loop tolerances]
CLIP_PARAM_TOL = 1e-5
CLIP_STEPS = 3
SYNC_EVERY_TOL = 1e-6
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP")


@dataclasses.dataclass(frozen=True)
class LoopCase:
    """The case a loop check's cell hands to ``Deviation.applies``."""

    model: str  # zoo model name
    sharding_strategy: str  # of every instance (the model may override one, e.g. NO_SHARD)
    # "no_sync" / "sync_every", "norm2" / "inf", "frozen", "inside" / "outside",
    # "unused_branch" / "two_forwards" / "eval_forward", ...
    variant: str


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
    """The zoo model wrapped by `adapter`: (root, zoo model); skips on a missing feature.
    `checkpointing`: each wrapped block under activation checkpointing, "inside" (or True) or
    "outside" its instance; `group`: None for the test's; `process_group`: what the instances
    shard over if not `group` (a hybrid pair)."""
    adapter_features.skip_unless(adapter, *zoo.MODELS[model_name].features)
    adapter_features.skip_unless(adapter, *adapter_features.wrap_features(**config))
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
    """The zoo model's input made different per `index` (floats scaled, integer ids rolled)."""
    return tuple(
        (t * (1.0 + 0.25 * index) if t.is_floating_point() else torch.roll(t, index, 0))
        if isinstance(t, torch.Tensor)
        else t
        for t in zoo_model.get_input(device)
    )


@dataclasses.dataclass
class Driver:
    """How one loop runs a model: FSDP through an adapter, or the reference (DDP or bare)."""

    model: nn.Module  # the wrapped root, the DDP module or the bare model
    zoo_model: nn.Module
    device: torch.device
    adapter: Any = None  # None: the reference
    optimizer_name: str = "sgd"  # "sgd" or "adam"; or assign `optimizer`

    @functools.cached_property
    def optimizer(self) -> torch.optim.Optimizer:
        adam = self.optimizer_name == "adam"
        options = {"lr": ADAM_LR} if adam else {"lr": training.LR, "momentum": training.MOMENTUM}
        if self.adapter is not None:
            return self.adapter.optimizer(self.model, self.optimizer_name, **options)
        return (torch.optim.Adam if adam else torch.optim.SGD)(self.model.parameters(), **options)

    def backward(self, loss: torch.Tensor) -> None:
        if self.adapter is None:
            self.zoo_model.run_backward(loss)
        else:
            self.zoo_model.run_backward(
                loss, functools.partial(training.adapter_backward, self.adapter, self.model)
            )

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        if self.adapter is None:
            return self.model.no_sync()
        return self.adapter.no_sync(self.model)

    def clip(self, max_norm: float, norm_type: float) -> torch.Tensor:
        if self.adapter is None:
            return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, norm_type)
        return self.adapter.clip_grad_norm_(self.model, max_norm, norm_type)

    def params(self) -> dict[str, torch.Tensor]:
        if self.adapter is not None:
            return self.adapter.full_params(self.model)
        return {
            name: param.detach().clone()
            for name, param in self.zoo_model.named_parameters(remove_duplicate=False)
        }

    def loss(self, index: int) -> torch.Tensor:
        inputs = micro_input(self.zoo_model, self.device, index)
        return self.zoo_model.get_loss(inputs, self.model(*inputs))

    def run(
        self,
        steps: int,
        *,
        start: int = 0,
        micro_batches: int = 1,
        sync_every: bool = True,
        same_input: bool = False,
        trace: CommTrace | None = None,
        loss: Callable[[int, int], torch.Tensor] | None = None,
        after_backward: Callable[[int], None] | None = None,
        after_step: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """`steps` optimizer steps from `start` of `micro_batches` micro-batches (loss / their
        number, all but the last inside ``no_sync`` unless `sync_every`; inputs
        ``micro_input(index)``, the step's first with `same_input`); returns every micro loss.
        `loss(step, index)` replaces ``self.loss(index)``; the hooks get the step."""
        losses = []
        for step in range(start, start + steps):
            self.optimizer.zero_grad()
            for micro in range(micro_batches):
                last = micro == micro_batches - 1
                if micro_batches > 1 and self.adapter is not None:
                    self.adapter.accumulation_boundary(self.model, last)
                context = contextlib.nullcontext() if sync_every or last else self.no_sync()
                phase = trace.phase(f"step {step} micro {micro}") if trace else None
                with context, phase or contextlib.nullcontext():
                    index = step * micro_batches + (0 if same_input else micro)
                    value = self.loss(index) if loss is None else loss(step, index)
                    value = value / micro_batches if micro_batches > 1 else value
                    self.backward(value)
                losses.append(value.detach().float())
            if after_backward is not None:
                after_backward(step)
            self.optimizer.step()
            if after_step is not None:
                after_step(step)
        return torch.stack(losses)


def fsdp_driver(
    adapter: Any, model_name: str, dist: Any, config: dict | None = None, **options: Any
) -> Driver:
    """``build``'s model in a Driver (`options`: ``build``'s, and ``optimizer_name``)."""
    name = options.pop("optimizer_name", "sgd")
    root, zoo_model = build(adapter, model_name, dist, config or {}, **options)
    return Driver(root, zoo_model, dist.device, adapter, name)


def ddp_driver(model_name: str, dist: Any, **options: Any) -> Driver:
    """``build_reference``'s model in a Driver (`options`: its, and ``optimizer_name``)."""
    name = options.pop("optimizer_name", "sgd")
    model, zoo_model = build_reference(model_name, dist, **options)
    return Driver(model, zoo_model, dist.device, optimizer_name=name)


def by_clean_name(adapter: Any, named: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """`named`'s (name, value) pairs by the unwrapped model's names (wrapper segments cut)."""
    segments = adapter.declarations.wrapper_segments
    return {clean_param_name(name, segments): value for name, value in named}


def unsharded(adapter: Any, root: nn.Module, step: int, skip_root: bool = False) -> list[str]:
    """``step <step>: <module>`` for each instance of `root` holding unsharded parameters."""
    instances = adapter.instances(root)[1 if skip_root else 0 :]
    return [
        f"step {step}: {type(adapter.unwrap(instance)).__name__}"
        for instance in instances
        if adapter.is_unsharded(instance)
    ]


def trainable_labels(adapter: Any, root: nn.Module, trace: CommTrace) -> dict[str, bool]:
    """Instance label -> whether the instance's own parameters include a trainable one."""
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
    training.assert_close(
        f"{label}: losses differ from DDP's ({training.tolerance_text(tol, tol)})",
        actual,
        expected,
        tol,
        tol,
        detail=f"FSDP losses {actual.tolist()}, DDP losses {expected.tolist()}",
    )


def compare(
    label: str, driver: Driver, losses: Any, reference: Driver, expected: Any, steps: int, tol=0.0
) -> None:
    """`losses` equal the reference's `expected`, and so do `driver`'s full parameters."""
    assert_losses(label, losses, expected, tol)
    assert_params(label, driver.params(), reference.params(), steps, tol, tol)


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
